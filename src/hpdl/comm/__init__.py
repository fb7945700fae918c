"""Communication layer: one `Communicator` interface over MPI, torch.distributed and a single process."""

from hpdl.comm.base import Communicator
from hpdl.comm.trace import Tracer
from hpdl.comm.work import Work

__all__ = ["Communicator", "Tracer", "Work"]
