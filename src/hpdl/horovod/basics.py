"""Horovod's process queries, build queries, reduction-op constants and error types, answered for hpdl.

The op constants have Horovod's integer values (Average=0 ... Product=5) so
that scripts comparing `op == hvd.Average` or storing ops in configs keep
working.
"""

from __future__ import annotations

from typing import Any

import torch

import hpdl
from hpdl.comm.base import Communicator
from hpdl.errors import CommError, HpdlError

__all__ = [
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "world",
    "size",
    "rank",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_homogeneous",
    "mpi_built",
    "mpi_enabled",
    "gloo_built",
    "gloo_enabled",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "mpi_threads_supported",
    "op_name",
]

Average = 0
Sum = 1
Adasum = 2
Min = 3
Max = 4
Product = 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
ENGINE_OPS = {Average: "sum", Sum: "sum", Min: "min", Max: "max", Product: "prod"}
"""What the communicator runs for each Horovod op (Average sums, then scales by 1/size as Horovod does)."""


class HorovodInternalError(HpdlError):
    """A collective failed (Horovod's error type; a RuntimeError). Elastic `run` treats it as recoverable."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's signal that the set of hosts changed (never raised by hpdl: its world size is fixed)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


def op_name(op: Any) -> str:
    return OP_NAMES.get(op, repr(op))


def check_op(op: Any, average: Any = None, default: int = Average) -> int:
    """Horovod's `average=` (deprecated) and `op=` arguments, resolved to one op constant."""
    if average is not None:
        if op is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return Average if average else Sum
    if op is None:
        return default
    if isinstance(op, bool) or op not in OP_NAMES:
        raise ValueError(f"op={op!r}: use hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max or hvd.Product")
    return int(op)


def world() -> Communicator:
    if not hpdl.is_initialized():
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return hpdl.world()


def size() -> int:
    """Number of ranks in the job."""
    return world().size


def rank() -> int:
    return world().rank


def local_rank() -> int:
    return world().local_rank


def local_size() -> int:
    return world().local_size


def cross_size() -> int:
    """Number of nodes (the same number of ranks on every node, as Horovod assumes when homogeneous)."""
    comm = world()
    return comm.size // comm.local_size


def cross_rank() -> int:
    comm = world()
    return comm.rank // comm.local_size


def is_homogeneous() -> bool:
    comm = world()
    return comm.size % comm.local_size == 0


def mpi_built() -> bool:
    """hpdl always ships its MPI backend (mpi4py on the MPICH wheel or the site's MPI)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def mpi_enabled() -> bool:
    """True when the job runs on the MPI backend (launched by mpiexec / mpirun / srun)."""
    return hpdl.is_initialized() and hpdl.world().backend == "mpi"


def gloo_built() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


def gloo_enabled() -> bool:
    return hpdl.is_initialized() and hpdl.world().backend == "torch" and hpdl.world().engine == "gloo"


def nccl_built() -> int:
    """Horovod returns the NCCL version it was built with (0 without): torch's NCCL where CUDA is usable."""
    if not (torch.cuda.is_available() and torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()
    return major * 1000 + minor * 100 + patch


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return torch.version.cuda is not None


def rocm_built() -> bool:
    return getattr(torch.version, "hip", None) is not None


def mpi_threads_supported() -> bool:
    """hpdl's MPI backend runs every call from the calling thread (MPI_THREAD_MULTIPLE is not required)."""
    if not mpi_enabled():
        return False
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def internal_error(exc: BaseException) -> HorovodInternalError:
    """Wrap an engine error as Horovod's (keeps the cause and its message)."""
    if isinstance(exc, HorovodInternalError):
        return exc
    error = HorovodInternalError(str(exc))
    error.__cause__ = exc
    return error


COMM_ERRORS = (CommError,)
