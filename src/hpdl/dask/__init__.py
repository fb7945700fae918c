"""Dask over MPI: the mpi:// transport for dask.distributed and Dask clusters started by mpiexec.

`initialize()` (or `hpdl dask`) turns the ranks of an MPI job into a Dask
cluster on mpi://; `MPIBackend` is the transport (registered as the
`distributed.comm.backends` entry point `mpi`). See docs/dask.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MPIBackend", "initialize", "run_cluster"]


def __getattr__(name: str) -> Any:
    # Lazy: importing hpdl.dask must not import distributed (or start MPI) until it is used.
    if name == "MPIBackend":
        from hpdl.dask.transport import MPIBackend

        return MPIBackend
    if name in ("initialize", "run_cluster"):
        from hpdl.dask import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module 'hpdl.dask' has no attribute {name!r}")
