"""`hpdl bench ml --quick` runs end to end and writes well-formed records; the ML lab runs and holds its claims.

Benchmarks are not tests: no timing is asserted, only the structure of the
output and the quality figures (hpdl's K-Means inertia equals scikit-learn's
from the same centres; hpdl's neighbours are exact).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpdl.bench.ml import CONTENDERS, launch

ROOT = Path(__file__).resolve().parent.parent


def test_quick_bench_writes_every_contender(tmp_path: Path) -> None:
    code = launch(["--quick", "--tasks", "kmeans", "--out", str(tmp_path)])  # one task: the test budget
    assert code == 0
    records = json.loads((tmp_path / "ml.json").read_text())
    assert {(r["task"], r["contender"]) for r in records} == {("kmeans", c) for c in CONTENDERS}
    by = {(r["task"], r["contender"]): r for r in records}
    for name in ("hpdl-mpi", "hpdl-dask", "sklearn"):
        km = by[("kmeans", name)]
        assert km["seconds"]["median"] > 0 and km["n_iter"] == 10 and km["ms_per_iter"] > 0 and km["rows"] == 20_000
        assert km["inertia"] == pytest.approx(by[("kmeans", "sklearn")]["inertia"], rel=1e-4)
    peer = by[("kmeans", "dask-ml")]  # its result or its error, never missing
    assert "error" in peer or peer["seconds"]["median"] > 0
    assert by[("kmeans", "hpdl-mpi")]["torch_version"] and by[("kmeans", "hpdl-mpi")]["quick"] is True
    markdown = (tmp_path / "ml.md").read_text()
    assert "## Targets" in markdown and ("PASS" in markdown or "MISS" in markdown)


def test_bad_arguments_return_an_exit_code() -> None:
    assert launch(["--tasks", "svm"]) == 2


def test_lab_runs_and_checks_its_claims(tmp_path: Path) -> None:
    plot = tmp_path / "lab.png"
    done = subprocess.run(
        [sys.executable, "-m", "hpdl.cli.main", "launch", "-n", "2", str(ROOT / "examples" / "lab_ml.py")]
        + ["--out", str(plot)],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.count("(same as scikit-learn: True)") == 4, out
    assert "(same as on the ranks: True)" in out and "False" not in out, out
    assert plot.stat().st_size > 10_000
