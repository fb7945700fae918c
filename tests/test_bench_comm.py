"""Smoke test of `hpdl bench comm --quick`: the benchmark code runs end to end on 2 ranks and writes its files.

It checks the shape of the output, never the timings (benchmarks are not tests).
"""

from __future__ import annotations

import json
from pathlib import Path

from hpdl.bench.comm import COLUMNS, OPS, SHM_OPS, launch


def test_quick_run_writes_every_op_and_column(tmp_path: Path) -> None:
    code = launch(["-n", "2", "--quick", "--out", str(tmp_path)])
    assert code == 0

    records = json.loads((tmp_path / "comm.json").read_text())
    latency = {(r["op"], r["column"]) for r in records if r["section"] == "latency"}
    expected = {(op, column) for op in OPS for column in COLUMNS if column != "hpdl-mpi-shm" or op in SHM_OPS}
    missing = expected - latency
    assert not missing, f"no records for {sorted(missing)}"
    for record in records:
        assert record["ranks"] == 2 and record["dtype"] == "float32"
        assert record["median_us"] > 0 and record["reps"] >= 1 and record["correct"]
        assert record["mpi_library_version"] and record["torch_version"] and record["hostname"]
    sections = {r["section"] for r in records}
    assert {"latency", "loop", "root", "copy", "fusion", "debug"} <= sections
    loops = {(r["op"], r["column"], r["bytes"]) for r in records if r["section"] == "loop"}
    assert loops == {(op, column, n) for op in OPS for column in ("hpdl-mpi", "mpi4py") for n in (4, 1024, 65536)}
    root = {(r["column"], r["bytes"], r["timing"]) for r in records if r["section"] == "root"}
    assert root == {(column, n, "rank 0") for column in ("hpdl-mpi", "mpi4py") for n in (4, 1024, 65536, 1 << 20)}

    markdown = (tmp_path / "comm.md").read_text()
    assert "### allreduce" in markdown and "## Back-to-back calls" in markdown and "## Targets" in markdown
    assert "back-to-back calls: hpdl-mpi within 1.30x of mpi4py" in markdown
    assert "## Broadcast, the root's time" in markdown
    assert "the root's time back to back: hpdl-mpi within 1.10x of mpi4py from 64 KiB" in markdown


def test_bad_arguments_return_an_exit_code_instead_of_raising() -> None:
    assert launch(["-n", "1"]) == 2
    assert launch(["--sizes", "6"]) == 2
