"""hpdl: high-performance distributed training over MPI and torch.distributed.

import hpdl
comm = hpdl.init()          # mpi, torch or self, from the launcher
comm.allreduce(tensor)      # in place, on torch tensors or NumPy arrays
hpdl.finalize()
"""

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
