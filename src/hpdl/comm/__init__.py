"""Communication layer: one `Communicator` interface over MPI, torch.distributed and a single process.

Its names load on first use: `hpdl.comm.env` (settings) is read by the launchers, which never import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpdl.comm.base import Communicator
    from hpdl.comm.trace import Tracer
    from hpdl.comm.work import Work

__all__ = ["Communicator", "Tracer", "Work"]

_HOMES = {"Communicator": "hpdl.comm.base", "Tracer": "hpdl.comm.trace", "Work": "hpdl.comm.work"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'hpdl.comm' has no attribute {name!r}")
