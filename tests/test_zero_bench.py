"""Smoke tests of `hpdl bench train --strategy zero --quick` and of examples/lab_zero.py (structure, not timings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hpdl.bench.train_zero import launch

CONTENDERS = ["hpdl-z1-mpi", "hpdl-z3-gloo", "hpdl-dp-mpi", "fsdp2-gloo"]
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def test_quick_run_writes_records_and_targets(tmp_path: Path) -> None:
    code = launch(["--quick", "--out", str(tmp_path), "--contenders", *CONTENDERS])
    assert code == 0
    records = json.loads((tmp_path / "train_zero.json").read_text())
    assert [r["contender"] for r in records] == CONTENDERS  # every peer ran here (none failed to build)
    losses = {round(r["loss"], 4) for r in records}
    assert len(losses) == 1  # same data, model and optimizer: every contender took the same first step
    for r in records:
        assert r["model"] == "mlp" and r["samples_per_s"]["median"] > 0 and r["torch_version"]
        assert r["peak_model_state_bytes"] > 0
    by = {r["contender"]: r["peak_model_state_bytes"] for r in records}
    assert by["hpdl-z3-gloo"] < by["hpdl-z1-mpi"] < by["hpdl-dp-mpi"]  # sharding saves memory, stage by stage
    markdown = (tmp_path / "train_zero.md").read_text()
    assert "## Targets" in markdown and "ZeRO formula" in markdown


def test_bad_arguments_return_an_exit_code() -> None:
    assert launch(["--strategy", "zero", "-n", "1"]) == 2
    assert launch(["--strategy", "zero", "--contenders", "nobody"]) == 2


def test_lab_trains_over_budget_model_and_reshards(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpdl.cli.main",
            "launch",
            "-n",
            "2",
            os.path.join(EXAMPLES, "lab_zero.py"),
            "--epochs",
            "2",
            "--out",
            str(tmp_path / "ckpt"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert output.count("(fits the budget: True)") == 2, output
    assert output.count("stage 3 -> stage 1 on 2 ranks: same predictions (same: True)") == 2, output
    assert "one plain process (epochs 2): same predictions (same: True); consolidated export (same: True)" in output
