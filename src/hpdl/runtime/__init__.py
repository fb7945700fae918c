"""Runtime: who am I (rank, size, node), which launcher started me, which backend to use.

The current communicator is `hpdl.world()`; inside this package `world` is the
module that defines it (`hpdl.runtime.world.world`), so the package does not
export a function of that name (importing the module would rebind it).
"""

import importlib
from typing import TYPE_CHECKING, Any

from hpdl.runtime.environment import Launch, detect

if TYPE_CHECKING:
    from hpdl.runtime.world import finalize, init, is_initialized

__all__ = ["Launch", "detect", "init", "finalize", "is_initialized"]

_FROM_WORLD = ("init", "finalize", "is_initialized")
"""Imported on first use: the world imports torch, and the launcher (which imports spawn from here) needs none."""


def __getattr__(name: str) -> Any:
    if name in _FROM_WORLD:
        return getattr(importlib.import_module("hpdl.runtime.world"), name)
    raise AttributeError(f"module 'hpdl.runtime' has no attribute {name!r}")
