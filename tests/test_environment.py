"""Which launcher started us, and which backend `auto` picks: pure logic on environment dictionaries."""

from __future__ import annotations

import os

import pytest

from hpdl.runtime.environment import detect

CASES = [
    ({}, "none", "self", 0, 1),
    ({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, "mpich", "mpi", 1, 4),
    (
        {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2"},
        "openmpi",
        "mpi",
        2,
        8,
    ),
    ({"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2"}, "mvapich", "mpi", 0, 2),
    ({"PMIX_RANK": "3"}, "pmix", "mpi", 3, None),
    ({"SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}, "slurm", "mpi", 5, 16),
    (
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x"},
        "torchrun",
        "torch",
        1,
        2,
    ),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "torchrun", "torch", 0, 2),
    ({"HPDL_BACKEND": "mpi", "PMI_RANK": "1", "PMI_SIZE": "2"}, "hpdl", "mpi", 1, 2),
    (
        {"HPDL_BACKEND": "torch", "RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "9"},
        "hpdl",
        "torch",
        1,
        3,
    ),
    ({"HPDL_BACKEND": "torch", "PMI_RANK": "0", "PMI_SIZE": "2"}, "hpdl", "torch", 0, 2),
]


@pytest.mark.parametrize("env,launcher,backend,rank,size", CASES)
def test_detect(env, launcher, backend, rank, size):
    found = detect(env)
    assert (found.launcher, found.backend, found.rank, found.size) == (launcher, backend, rank, size)


def test_slurm_allocation_without_srun_is_not_a_launch():
    # sbatch sets SLURM_PROCID in the batch script itself; only an srun step means ranks.
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).backend == "self"


def test_unknown_forced_backend_is_rejected():
    with pytest.raises(ValueError, match="HPDL_BACKEND='nccl'"):
        detect({"HPDL_BACKEND": "nccl"})


def test_open_mpi_jobs_of_a_few_ranks_get_libnbcs_reduce_scatter_allgather_allreduce_unless_the_user_chose():
    from hpdl.runtime.open_mpi import IALLREDUCE_ALGORITHM, UP_TO_RANKS, choose_defaults

    for env, expected in (
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "3"),
        ({"OMPI_COMM_WORLD_SIZE": str(UP_TO_RANKS)}, "3"),
        ({"OMPI_COMM_WORLD_SIZE": str(UP_TO_RANKS + 1)}, None),  # its ring fallback for tiny messages
        ({"OMPI_COMM_WORLD_SIZE": "1"}, None),
        ({"OMPI_COMM_WORLD_SIZE": "2", IALLREDUCE_ALGORITHM: "1"}, "1"),
        ({"PMI_SIZE": "2"}, None),  # MPICH
    ):
        choose_defaults(env)
        assert env.get(IALLREDUCE_ALGORITHM) == expected, env


def test_open_mpi_4_ranks_get_its_shared_memory_and_point_to_point_one_sided_components_unless_the_user_chose():
    """Its osc/rdma hung the progress boards of jobs with many sub-communicators; Open MPI 5 has no pt2pt."""
    from hpdl.runtime.open_mpi import ONE_SIDED, choose_defaults

    for env, expected in (
        ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_MCA_orte_hnp_uri": "1.0;tcp://127.0.0.1:1"}, "sm,pt2pt"),  # ORTE
        ({"OMPI_COMM_WORLD_SIZE": "4", "PRTE_LAUNCHED": "1"}, None),  # Open MPI 5
        ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://127.0.0.1:1", ONE_SIDED: "ucx"}, "ucx"),
    ):
        choose_defaults(env)
        assert env.get(ONE_SIDED) == expected, env


def test_importing_hpdl_chooses_open_mpis_defaults_before_any_part_of_it_starts_mpi():
    """Any hpdl module may import mpi4py's MPI (which starts MPI) first, not only `hpdl.init`: a test importing
    `hpdl.comm.mpi_backend` in a process no mpiexec started aborted on pip's Open MPI 4 (no OPAL_PREFIX)."""
    import subprocess
    import sys

    from hpdl.runtime.open_mpi import IALLREDUCE_ALGORITHM

    script = (
        "import os, sys; import hpdl.comm.env; "
        f"print(os.environ.get({IALLREDUCE_ALGORITHM!r}), 'mpi4py.MPI' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != IALLREDUCE_ALGORITHM}
    env["OMPI_COMM_WORLD_SIZE"] = "2"  # as in a rank of Open MPI's launcher
    shown = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert shown.stdout.split() == ["3", "False"]  # set on import, and MPI not started by it


def test_pips_open_mpi_4_wheel_is_told_where_it_lives_unless_the_user_said(tmp_path):
    """Without OPAL_PREFIX that wheel's MPI_Init aborts any process its mpiexec did not start (`hpdl info`)."""
    from hpdl.runtime.open_mpi import choose_defaults

    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libmpi.so.40").write_bytes(b"")
    env: dict = {}
    choose_defaults(env, prefix=str(tmp_path))
    assert env == {}  # no orted: Open MPI 5's wheel, or a system MPI
    (tmp_path / "bin" / "orted").write_bytes(b"")
    (tmp_path / "bin" / "orted").chmod(0o755)
    choose_defaults(env, prefix=str(tmp_path))
    assert env == {"OPAL_PREFIX": str(tmp_path)}
    mine = {"OPAL_PREFIX": "/opt/openmpi"}
    choose_defaults(mine, prefix=str(tmp_path))
    assert mine == {"OPAL_PREFIX": "/opt/openmpi"}
