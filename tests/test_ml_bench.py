"""`hpdl bench ml --quick` runs end to end and writes well-formed records (the ML lab: tests/test_examples.py).

Benchmarks are not tests: no timing is asserted, only the structure of the
output and the quality figures (hpdl's K-Means inertia equals scikit-learn's
from the same centres; hpdl's neighbours are exact).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpdl.bench.ml import CONTENDERS, launch
from targets import checked_targets


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
    assert "error" not in peer and peer["seconds"]["median"] > 0, peer  # dask-ml is in the test environment
    assert by[("kmeans", "hpdl-mpi")]["torch_version"] and by[("kmeans", "hpdl-mpi")]["quick"] is True
    markdown = (tmp_path / "ml.md").read_text()
    targets = checked_targets(markdown)  # each verdict the one its numbers earn
    assert targets and all(" kmeans: " in t for t in targets), targets


def test_bad_arguments_return_an_exit_code() -> None:
    assert launch(["--tasks", "svm"]) == 2
