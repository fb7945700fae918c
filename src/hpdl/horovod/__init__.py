"""A Horovod-compatible PyTorch API on hpdl: `import hpdl.horovod as hvd` in place of `import horovod.torch as hvd`.

    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Collectives are matched by name and checked on every rank as Horovod's
coordinator does (`hpdl.horovod.engine`). What differs from Horovod is
listed in docs/data_parallel.md.
"""

from __future__ import annotations

from typing import Any, Optional

import hpdl
from hpdl.horovod import elastic
from hpdl.horovod.basics import (
    Adasum,
    Average,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    size,
)
from hpdl.horovod.compression import Compression, Compressor
from hpdl.horovod.functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from hpdl.horovod.ops import *  # noqa: F403
from hpdl.horovod.ops import __all__ as _ops_all
from hpdl.horovod.optimizer import DistributedOptimizer
from hpdl.horovod.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from hpdl.horovod.sync_batch_norm import SyncBatchNorm
from hpdl.horovod.timeline import start_timeline, stop_timeline

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "size",
    "rank",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_homogeneous",
    "mpi_built",
    "mpi_enabled",
    "gloo_built",
    "gloo_enabled",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "mpi_threads_supported",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Compression",
    "Compressor",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "DistributedOptimizer",
    "SyncBatchNorm",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "broadcast_object",
    "allgather_object",
    "start_timeline",
    "stop_timeline",
    "elastic",
    *_ops_all,
]


def init(comm: Any = None, process_sets: Optional[Any] = None) -> None:
    """Start hpdl (`hpdl.init()`: the backend comes from the launcher) and the Horovod state on it.

    `process_sets`: ProcessSet objects (or rank lists) to add at once, or "dynamic" (always allowed here).
    `comm`: None, or the whole world (a list of every rank, or MPI.COMM_WORLD); a sub-world is not supported.
    """
    from hpdl.horovod import engine
    from hpdl.horovod.process_sets import registry

    world = hpdl.init()
    if comm is not None and not _is_whole_world(comm, world.size):
        raise NotImplementedError(
            "hvd.init(comm=...) with a subset of the ranks is not supported; start the job with only those ranks, "
            "or use hvd.ProcessSet / hvd.add_process_set for collectives on a subset"
        )
    if registry.world is not world:
        registry.reset(world)
        engine.reset()
    if process_sets is not None and process_sets != "dynamic":
        for ps in process_sets:
            if isinstance(ps, ProcessSet) and ps.process_set_id is not None:
                continue
            add_process_set(ps)


def _is_whole_world(comm: Any, world_size: int) -> bool:
    if isinstance(comm, (list, tuple, range)):
        return sorted(comm) == list(range(world_size))
    try:
        from mpi4py import MPI
    except ImportError:
        return False
    return (
        isinstance(comm, MPI.Comm)
        and comm.Get_size() == world_size
        and MPI.Comm.Compare(comm, MPI.COMM_WORLD)
        in (
            MPI.IDENT,
            MPI.CONGRUENT,
        )
    )


def shutdown() -> None:
    """Finish every queued operation's bookkeeping and close hpdl's world."""
    from hpdl.horovod import engine
    from hpdl.horovod.process_sets import registry

    engine.reset()
    registry.world = None
    hpdl.finalize()


def is_initialized() -> bool:
    from hpdl.horovod.process_sets import registry

    return hpdl.is_initialized() and registry.world is hpdl.world()
