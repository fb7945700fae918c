"""Runtime: who am I (rank, size, node), which launcher started me, which backend to use.

The current communicator is `hpdl.world()`; inside this package `world` is the
module that defines it (`hpdl.runtime.world.world`), so the package does not
export a function of that name (importing the module would rebind it).
"""

from hpdl.runtime.environment import Launch, detect
from hpdl.runtime.world import finalize, init, is_initialized

__all__ = ["Launch", "detect", "init", "finalize", "is_initialized"]
