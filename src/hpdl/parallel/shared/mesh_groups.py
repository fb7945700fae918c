"""`MeshGroups`: what a strategy needs to know of a mesh, its three sub-communicators, without importing `Mesh`.

`hpdl.parallel.Mesh` (in `hpdl.parallel.mesh`, which sits above every
strategy) satisfies it; a strategy that combines a norm or a state across
the mesh (ZeRO's clipping over dp, tp and pp) checks for it instead.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from hpdl.comm.base import Communicator

__all__ = ["MeshGroups"]


@runtime_checkable
class MeshGroups(Protocol):
    """This rank's data-, pipeline- and tensor-parallel communicators."""

    @property
    def dp(self) -> Communicator: ...

    @property
    def pp(self) -> Communicator: ...

    @property
    def tp(self) -> Communicator: ...
