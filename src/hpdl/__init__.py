"""hpdl: high-performance distributed training over MPI and torch.distributed.

import hpdl
comm = hpdl.init()          # mpi, torch or self, from the launcher
comm.allreduce(tensor)      # in place, on torch tensors or NumPy arrays
hpdl.finalize()
"""

import importlib
from typing import TYPE_CHECKING, Any

from hpdl._version import __version__
from hpdl.errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    HpdlError,
    NotInitializedError,
)
from hpdl.interop.registration import register_when_torch_loads
from hpdl.runtime import open_mpi as _open_mpi

if TYPE_CHECKING:
    from hpdl.comm.base import Communicator
    from hpdl.comm.work import Work
    from hpdl.runtime.world import finalize, init, is_initialized, world


__all__ = [
    "init",
    "finalize",
    "world",
    "is_initialized",
    "Communicator",
    "Work",
    "HpdlError",
    "CommError",
    "CommTimeoutError",
    "CollectiveMismatchError",
    "NotInitializedError",
    "BackendUnavailableError",
    "__version__",
]

_LAZY = {
    "init": "hpdl.runtime.world",
    "finalize": "hpdl.runtime.world",
    "world": "hpdl.runtime.world",
    "is_initialized": "hpdl.runtime.world",
    "Communicator": "hpdl.comm.base",
    "Work": "hpdl.comm.work",
}
"""Names imported on first use: they import torch, and `import hpdl` stays light (the launcher needs no torch)."""

_SUBPACKAGES = ("checkpoint", "comm", "runtime", "interop", "parallel", "ml", "train", "plan")
"""Imported on first attribute access (`hpdl.checkpoint.save`)."""

register_when_torch_loads()
# Before any part of hpdl starts MPI (mpi4py starts it when `MPI` is first imported): Open MPI reads these settings
# only then, and pip's Open MPI 4 cannot start at all in a process its mpiexec did not start without OPAL_PREFIX.
_open_mpi.choose_defaults()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"hpdl.{name}")
    raise AttributeError(f"module 'hpdl' has no attribute {name!r}")
