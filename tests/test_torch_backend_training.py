"""Unmodified DDP, FSDP2, DTensor tensor parallel, pipelining and DCP on the "hpdl" backend.

Parameters after a few steps equal one process on the whole batch (float64,
1e-10), on 2 and 3 MPI ranks; the same code on gloo is run beside it where
the result is not exact (PowerSGD, mixed precision).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import torch_backend_bodies as bodies
import torch_backend_training as training
from hpdl.runtime.spawn import mpiexec_argv
from test_torch_backend import POOL_ENV

TOL = 1e-10
TESTS = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(TESTS, "scripts", "torch_ddp_job.py")


@pytest.fixture(params=[2, 3], ids=["2-ranks", "3-ranks"])
def pool(request, ranks):
    return ranks("mpi", request.param, POOL_ENV)


@pytest.fixture(scope="module")
def reference():
    return training.reference()


def _close(params, expected, tol=TOL):
    assert len(params) == len(expected)
    for p, e in zip(params, expected):
        np.testing.assert_allclose(np.array(p), np.array(e), rtol=tol, atol=tol)


@pytest.mark.parametrize("hook", [None, "allreduce"])
def test_ddp_equals_one_process(pool, reference, hook):
    for params in pool.run(training.ddp, "hpdl", hook, timeout=120):
        _close(params, reference)


def test_ddp_powersgd_equals_one_process(ranks, reference):
    # (On gloo this hook deadlocks here: its callbacks block gloo's own worker threads.)
    pool = ranks("mpi", 2, POOL_ENV)
    for params in pool.run(training.ddp, "hpdl", "powersgd", timeout=120):
        _close(params, reference, 1e-8)


def test_compiled_ddp_equals_one_process(ranks, reference):
    # A pool of its own: the group is made before anything imports torch._dynamo (it once failed only then).
    pool = ranks("mpi", 2, {**POOL_ENV, "HPDL_TEST_POOL": "compile"})
    for params in pool.run(training.ddp, "hpdl", None, True, timeout=240):
        _close(params, reference)


def test_fsdp2_equals_one_process(pool, reference):
    for params in pool.run(training.fsdp2, "hpdl", timeout=120):
        _close(params, reference)


def test_fsdp2_with_buffers_from_the_group_equals_one_process(pool, reference):
    """`set_allocate_memory_from_process_group_for_comm(True)`: FSDP2's all-gather and reduce-scatter buffers
    come from hpdl's pool, reused from the second step on, and training is unchanged."""
    for params, made, reused in pool.run(training.fsdp2, "hpdl", False, True, timeout=120):
        _close(params, reference)
        assert made > 0 and reused > 0, (made, reused)


def test_hsdp_on_a_two_dimensional_mesh_equals_one_process(ranks, reference):
    """FSDP2 over a 2 x 2 mesh (replicate x shard): DeviceMesh makes the row and column groups on "hpdl"."""
    pool = ranks("mpi", 4)
    for sub_groups, params in pool.run(training.hsdp, timeout=120):
        assert sub_groups == [("hpdl", 2), ("hpdl", 2)]
        _close(params, reference)


def test_fsdp2_mixed_precision_equals_gloo(ranks, reference):
    pool = ranks("mpi", 2, POOL_ENV)
    mine, theirs = pool.run(training.fsdp2, "hpdl", True), pool.run(training.fsdp2, "gloo", True)
    for a, b in zip(mine, theirs):
        _close(a, b, 1e-6)
        _close(a, reference, 1e-4)


def test_tensor_parallel_equals_one_process(ranks, reference):
    pool = ranks("mpi", 2, POOL_ENV)
    for params in pool.run(training.tensor_parallel, "hpdl", timeout=120):
        _close(params, reference)


def test_pipeline_two_stages_equals_one_process(ranks, reference):
    pool = ranks("mpi", 2, POOL_ENV)
    first, second = pool.run(training.pipeline, "hpdl", timeout=120)
    _close(first + second, reference)


def test_checkpoint_saved_sharded_loads_unsharded(ranks, tmp_path):
    pool = ranks("mpi", 2, POOL_ENV)
    for saved, loaded in pool.run(training.checkpoint_reshard, "hpdl", str(tmp_path / "ckpt"), timeout=120):
        _close(loaded, saved, 0)


def test_plain_mpiexec_ddp_and_a_failing_rank_ends_the_job():
    """Under plain mpiexec (no MASTER_ADDR), a script that never imports hpdl: DDP equals one process, and a
    rank that raises ends the job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPDL_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env["PYTHONPATH"] = os.pathsep.join([TESTS, env.get("PYTHONPATH", "")])
    started = time.monotonic()
    done = subprocess.run(
        [*mpiexec_argv(3), sys.executable, "-u", JOB, "raise"],
        env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    worst = dict(
        re.findall(r"rank (\d) of 3: largest difference (\d\.\d+e[-+]\d+)", output)
    )  # ranks' lines may interleave
    assert sorted(worst) == ["0", "1", "2"], output[-3000:]
    assert all(float(value) < TOL for value in worst.values()), worst
    assert output.count("backend hpdl without importing hpdl") == 3, output[-3000:]  # torch's entry point
    assert "ValueError: the last rank fails on purpose" in output, output[-3000:]
    assert time.monotonic() - started < 200


def test_accelerate_loop_equals_one_process(ranks, reference):
    pool = ranks("mpi", 2, POOL_ENV)
    for backend, params in pool.run(training.accelerate_loop, timeout=120):
        assert backend == "hpdl"
        _close(params, reference)


def test_lightning_fit_equals_one_process(ranks, reference):
    pool = ranks("mpi", 2, POOL_ENV)
    for backend, params in pool.run(training.lightning_fit, timeout=180):
        assert backend == "hpdl"
        _close(params, reference)


def test_skipped_new_group_and_collective_are_timeouts_naming_the_rank(ranks):
    pool = ranks("mpi", 3, POOL_ENV)
    started = time.monotonic()
    results = pool.run(bodies.skipped_calls, 2.0, timeout=60)
    pool.kill()  # the skipped all_reduce is still pending on two ranks: the next user gets a fresh pool
    assert results[-1] is None
    (group_0, reduce_0), (group_1, reduce_1) = results[:-1]
    # MPI_Comm_create_group would wait for the missing member forever; the members' meeting is bounded
    assert group_0[0] == group_1[0] == "CommTimeoutError", results
    assert "no word from rank(s) [2]" in group_0[1] and "no answer from rank(s) [0]" in group_1[1], results
    for kind, message in (reduce_0, reduce_1):
        assert kind == "CommTimeoutError" and "Did not arrive: rank 2" in message, results
        waited = re.search(r"did not complete within ([0-9.]+) s", message)  # how long it waited (said 0.0 s)
        assert waited and float(waited.group(1)) >= 2.0, message
    assert time.monotonic() - started < 40
