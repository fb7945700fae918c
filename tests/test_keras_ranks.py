"""hpdl.keras on 3 and 4 ranks, in one job of 4 ranks (Keras ranks cost seconds to start): data parallel on a
process set of 3 ranks equals one process (float64 and float32, graph and eager), and a Keras model trained as a
dp x pp = 2 x 2 pipeline equals one process (forward, gradients, 3 steps)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

if importlib.util.find_spec("keras") is None:
    pytest.skip("Keras is not installed (requirements-dev.txt: Python 3.11 to 3.13)", allow_module_level=True)

from test_keras import TORCH_FLOAT64, check_dp

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "keras_ranks.py")


def test_three_rank_data_parallel_and_a_dp_by_pp_pipeline(tmp_path):
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "hpdl.cli.main", "launch", "-n", "4", SCRIPT, str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert results[3]["dp3"] is None  # outside the process set
    check_dp([r["dp3"] for r in results[:3]], TORCH_FLOAT64)
    check_dp([r["dp3_eager"] for r in results[:3]], 1e-5)
    pipes = [r["dpxpp"] for r in results]  # ranks 0, 1: replica 0's stages 0, 1; ranks 2, 3: replica 1's
    assert [p["layers"] for p in pipes] == [2, 1, 2, 1]
    assert pipes[0]["out"] is None and pipes[2]["out"] is None
    assert pipes[1]["out"] < TORCH_FLOAT64 and pipes[3]["out"] < TORCH_FLOAT64
    for p in pipes:
        assert p["grad"] < TORCH_FLOAT64 and p["weights"] < TORCH_FLOAT64
    assert pipes[0]["losses"] == pipes[1]["losses"] and pipes[2]["losses"] == pipes[3]["losses"]
