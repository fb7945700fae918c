"""Runtime: who am I (rank, size, node), which launcher started me, which backend to use."""

from hpdl.runtime.environment import Launch, detect
from hpdl.runtime.world import finalize, init, is_initialized, world

__all__ = ["Launch", "detect", "init", "finalize", "world", "is_initialized"]
