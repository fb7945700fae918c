"""Who launched us: read the launcher's environment variables to pick a backend and find our rank.

`hpdl launch` sets HPDL_BACKEND; otherwise Open MPI, MPICH/Hydra (and Intel
MPI, MVAPICH2), PMIx, Slurm's srun and torchrun each leave their own
variables. With none of them the process is alone and gets the `self`
backend, so every script also runs as `python script.py`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping, Optional

import hpdl.settings as settings

__all__ = [
    "RESTART_COUNT",
    "STORE_FD",
    "Launch",
    "detect",
    "is_loopback",
    "loopback_interface",
    "restart_count",
    "torch_release",
]

RESTART_COUNT = "HPDL_RESTART_COUNT"
"""How many times `hpdl launch --max-restarts` has started this job again (0: the first run)."""

STORE_FD = "HPDL_STORE_FD"
"""Set for rank 0 of a torch job whose launcher (or rank 0 itself) bound the rendezvous store's socket: its fd."""

BACKENDS = ("mpi", "torch", "self")


def restart_count() -> int:
    """0 on a job's first run; k on its k-th restart by `hpdl launch --max-restarts` (torchrun's: its own count)."""
    for name in (RESTART_COUNT, "TORCHELASTIC_RESTART_COUNT"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def torch_release() -> tuple[int, int]:
    """The installed torch's (major, minor): "2.13.0+cpu" and "2.14.0a0+git..." alike (imports torch)."""
    import torch

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


@dataclass(frozen=True)
class Launch:
    """What the environment says about this process."""

    launcher: str
    """'hpdl', 'torchrun', 'openmpi', 'mpich', 'mvapich', 'pmix', 'slurm' or 'none'."""
    backend: str
    """The backend `init(backend="auto")` picks here."""
    rank: Optional[int] = None
    size: Optional[int] = None
    local_rank: Optional[int] = None
    local_size: Optional[int] = None


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            try:
                return int(value)  # type: ignore[arg-type]
            except ValueError:
                continue
    return None


def _torch_env(env: Mapping[str, str]) -> bool:
    return all(env.get(name) for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def detect(env: Optional[Mapping[str, str]] = None) -> Launch:
    """Read the launcher from `env` (default: os.environ)."""
    env = os.environ if env is None else env
    mpi = _mpi_launch(env)
    forced = settings.text("HPDL_BACKEND", env) or ""  # checked: one of BACKENDS
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"HPDL_BACKEND={forced!r}: choose one of {', '.join(BACKENDS)}")
        if forced == "torch" and _torch_env(env):
            return _torch_launch("hpdl", env)
        base = mpi or Launch("none", forced)
        return Launch("hpdl", forced, base.rank, base.size, base.local_rank, base.local_size)
    if env.get("TORCHELASTIC_RUN_ID") or (_torch_env(env) and mpi is None):
        return _torch_launch("torchrun", env)
    if mpi is not None:
        return mpi
    return Launch("none", "self", 0, 1, 0, 1)


def _torch_launch(launcher: str, env: Mapping[str, str]) -> Launch:
    return Launch(
        launcher,
        "torch",
        _int(env, "RANK"),
        _int(env, "WORLD_SIZE"),
        _int(env, "LOCAL_RANK"),
        _int(env, "LOCAL_WORLD_SIZE"),
    )


def _mpi_launch(env: Mapping[str, str]) -> Optional[Launch]:
    """The MPI-style launcher that started this process, if any."""
    if "OMPI_COMM_WORLD_SIZE" in env:
        return Launch(
            "openmpi",
            "mpi",
            _int(env, "OMPI_COMM_WORLD_RANK"),
            _int(env, "OMPI_COMM_WORLD_SIZE"),
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
            _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        )
    if "MV2_COMM_WORLD_SIZE" in env:
        return Launch(
            "mvapich",
            "mpi",
            _int(env, "MV2_COMM_WORLD_RANK"),
            _int(env, "MV2_COMM_WORLD_SIZE"),
            _int(env, "MV2_COMM_WORLD_LOCAL_RANK"),
            _int(env, "MV2_COMM_WORLD_LOCAL_SIZE"),
        )
    if "PMI_SIZE" in env or "PMI_RANK" in env:  # MPICH's Hydra, Intel MPI
        return Launch(
            "mpich",
            "mpi",
            _int(env, "PMI_RANK"),
            _int(env, "PMI_SIZE"),
            _int(env, "MPI_LOCALRANKID"),
            _int(env, "MPI_LOCALNRANKS"),
        )
    if "PMIX_RANK" in env:
        return Launch("pmix", "mpi", _int(env, "PMIX_RANK"), None, _int(env, "PMIX_LOCAL_RANK"), None)
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:  # inside an srun step
        return Launch(
            "slurm",
            "mpi",
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
            _int(env, "SLURM_LOCALID"),
            None,
        )
    return None


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback, where only local ranks can connect."""
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def loopback_interface() -> str:
    """The name of the loopback interface ('lo' on Linux, 'lo0' on macOS and BSD), for GLOO_SOCKET_IFNAME."""
    names = [name for _, name in socket.if_nameindex()]
    return next((name for name in ("lo", "lo0") if name in names), "lo")
