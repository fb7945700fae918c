"""`hpdl launch` and job-wide failure handling, through real launches (a few seconds each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

JOB = os.path.join(os.path.dirname(__file__), "scripts", "job.py")
HPDL = [sys.executable, "-m", "hpdl.cli.main"]


def launch(*args: str, env: dict | None = None, timeout: float = 90) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run(
        HPDL + ["launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_successful_job_exits_zero_with_tagged_output(backend):
    code, output, _ = launch("-n", "2", "--backend", backend, "--tag-output", JOB, "ok")
    assert code == 0, output
    assert "[0] rank 0 of 2 on " + backend in output.replace("[0]rank", "[0] rank"), output
    assert "sum 3" in output


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_exception_on_one_rank_stops_the_job_with_one_traceback(backend):
    code, output, elapsed = launch("-n", "2", "--backend", backend, JOB, "raise")
    assert code != 0, output
    assert output.count("Traceback (most recent call last)") == 1, output
    assert output.count("RuntimeError: boom on the last rank") == 1, output
    assert elapsed < 30, output


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_nonzero_exit_of_one_rank_is_the_job_exit_code(backend):
    code, output, elapsed = launch("-n", "2", "--backend", backend, JOB, "exit3")
    assert code == 3, output
    assert elapsed < 25, output


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_rank_that_dies_mid_collective_ends_the_job(backend):
    code, output, elapsed = launch("-n", "2", "--backend", backend, JOB, "die", env={"JOB_TIMEOUT": "10"})
    assert code != 0, output
    assert elapsed < 30, output


def test_gloo_job_without_finalize_exits_cleanly():
    # torch 2.13 + gloo aborts at exit unless the group is torn down after a barrier.
    for _ in range(3):
        code, output, _ = launch("-n", "2", "--backend", "torch", JOB, "noexit")
        assert code == 0, output
        assert "terminate called" not in output


def test_launcher_usage_errors():
    code, output, _ = launch("-n", "2", "no_such_script.py")
    assert code == 2 and "not found" in output
    code, output, _ = launch("-n", "0", JOB, "ok")
    assert code == 2 and "at least one rank" in output


def test_info_reports_versions_backends_and_launcher():
    done = subprocess.run(HPDL + ["info", "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["mpi library"].startswith(("MPICH", "Open MPI", "Intel", "MVAPICH"))
    assert info["torch.distributed"]["gloo"] is True
    assert info["launcher"]["detected"] == "none" and info["launcher"]["auto backend"] == "self"
    assert "GPU" in info["cuda"]["mpi backend GPU path"]
    text = subprocess.run(HPDL + ["info"], capture_output=True, text=True, timeout=60).stdout
    assert "mpi library:" in text and "launcher:" in text
