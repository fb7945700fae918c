"""hpdl: high-performance distributed training over MPI and torch.distributed.

import hpdl
comm = hpdl.init()          # mpi, torch or self, from the launcher
comm.allreduce(tensor)      # in place, on torch tensors or NumPy arrays
hpdl.finalize()
"""

import importlib
from typing import Any

from hpdl.comm.base import Communicator
from hpdl.comm.work import Work
from hpdl.errors import (
    BackendUnavailableError,
    CollectiveMismatchError,
    CommError,
    CommTimeoutError,
    HpdlError,
    NotInitializedError,
)
from hpdl.runtime.world import finalize, init, is_initialized, world

__version__ = "0.1.0"

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


def _register_torch_backend() -> None:
    from hpdl.interop.registration import register

    register()


_register_torch_backend()

_SUBPACKAGES = ("checkpoint", "parallel", "ml", "train", "plan")
"""Imported on first attribute access (`hpdl.checkpoint.save`), so `import hpdl` stays light."""


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"hpdl.{name}")
    raise AttributeError(f"module 'hpdl' has no attribute {name!r}")
