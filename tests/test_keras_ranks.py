"""hpdl.keras on 3 and 4 ranks, on the 4-rank pool of the mesh group (conftest.SHARED_POOLS: ranks cost seconds to
start): data parallel on a process set of 3 ranks equals one process (float64 and float32, graph and eager), and a
Keras model trained as a dp x pp = 2 x 2 pipeline equals one process (forward, gradients, 3 steps)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

if importlib.util.find_spec("keras") is None:
    pytest.skip("Keras is not installed (requirements-dev.txt: Python 3.11 to 3.13)", allow_module_level=True)

from test_keras import TORCH_FLOAT64, check_dp, dp_fit_body, pipeline_body


def keras_ranks_body(comm: Any) -> dict:
    """On the 4 ranks of the mesh group's pool (no Keras imported there yet): Keras on the torch backend."""
    import sys

    if "keras" in sys.modules and os.environ.get("KERAS_BACKEND") != "torch":
        raise RuntimeError("this pool's ranks imported Keras with another backend; KERAS_BACKEND is read once")
    os.environ["KERAS_BACKEND"] = "torch"
    return {
        "dp3": dp_fit_body(comm, "float64", False, members=[0, 1, 2]),
        "dp3_eager": dp_fit_body(comm, "float32", True, members=[0, 1, 2]),
        "dpxpp": pipeline_body(comm, "1f1b", 3, 2),
    }


def test_three_rank_data_parallel_and_a_dp_by_pp_pipeline(ranks):
    results = ranks("mpi", 4).run(keras_ranks_body, timeout=300)
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
