"""Smoke test of `hpdl bench dask --quick`: one launch end to end, records of the right shape (never timings)."""

from __future__ import annotations

import json
from pathlib import Path

from hpdl.bench.dask_transport import PROTOCOLS, launch
from targets import checked_targets


def test_quick_run_writes_both_transports(tmp_path: Path) -> None:
    code = launch(["--quick", "--sizes", "1", "1M", "--reps", "1", "--xxt-reps", "1", "--out", str(tmp_path)])
    assert code == 0
    records = json.loads((tmp_path / "dask.json").read_text())
    ping = [r for r in records if r["measurement"] == "pingpong"]
    assert {(r["transport"], r["bytes"]) for r in ping} == {(p, b) for p in PROTOCOLS for b in (1, 1 << 20)}
    for r in ping:
        assert r["latency_us"]["median"] > 0 and r["throughput_MBps"]["median"] > 0 and r["mpi_library"]
    xxt = {r["transport"]: r for r in records if r["measurement"] == "x+x.T"}
    assert set(xxt) == set(PROTOCOLS)
    assert xxt["mpi"]["result"] == xxt["tcp"]["result"]  # the same sum on both clusters
    assert xxt["mpi"]["seconds"]["median"] > 0 and "speedup_vs_tcp" in xxt["mpi"]
    markdown = (tmp_path / "dask.md").read_text()
    targets = checked_targets(markdown)  # each verdict the one its numbers earn
    assert [t.split(" ", 2)[1] for t in targets] == ["throughput,", "x"], targets


def test_bad_arguments_return_an_exit_code() -> None:
    assert launch(["--reps", "0"]) == 2
    assert launch(["--sizes", "lots"]) == 2
