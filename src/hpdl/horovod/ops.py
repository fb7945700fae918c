"""Horovod's process functions and collectives, on the hpdl world communicator."""

from __future__ import annotations

import itertools
from typing import Any, Optional, Union

import torch

import hpdl
from hpdl.comm.base import Communicator
from hpdl.comm.work import Work
from hpdl.parallel.data.data_parallel import broadcast_tensors

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
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "Compression",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "allgather",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "synchronize",
    "poll",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "broadcast_object",
    "allgather_object",
    "join",
    "mpi_built",
    "gloo_built",
    "nccl_built",
    "mpi_threads_supported",
]

# Reduction ops: Horovod's names, hpdl's values.
Average = "avg"
Sum = "sum"
Adasum = "adasum"
Min = "min"
Max = "max"
Product = "prod"


class _Compressor:
    """A wire dtype for gradients (Horovod's Compression.none / .fp16)."""

    def __init__(self, name: Optional[str]):
        self.name = name

    def __repr__(self) -> str:
        return f"Compression.{self.name or 'none'}"


class Compression:
    """Gradient compression for DistributedOptimizer and allreduce: `none`, `fp16` (and hpdl's `bf16`)."""

    none = _Compressor(None)
    fp16 = _Compressor("fp16")
    bf16 = _Compressor("bf16")


def compression_name(compression: Any) -> Optional[str]:
    if isinstance(compression, _Compressor):
        return compression.name
    raise TypeError(
        f"compression={compression!r}: hpdl.horovod supports hvd.Compression.none, .fp16 and .bf16 "
        "(custom Compressor classes are not supported)"
    )


def check_op(op: Any) -> str:
    if op == Adasum:
        raise NotImplementedError(
            "hpdl.horovod does not implement Adasum (adaptive summation); use op=hvd.Average, or a large-batch "
            "optimizer such as LARS/LAMB from hpdl.train for the same purpose"
        )
    if op not in (Average, Sum, Min, Max, Product):
        raise ValueError(f"op={op!r}: use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    return str(op)


# --------------------------------------------------------------------------- process
def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start hpdl (`hpdl.init()`: the backend comes from the launcher: mpiexec -> mpi, torchrun -> torch)."""
    if comm is not None or process_sets is not None:
        raise NotImplementedError("hpdl.horovod.init: comm= and process_sets= are not supported; call hvd.init()")
    hpdl.init()


def shutdown() -> None:
    hpdl.finalize()


def is_initialized() -> bool:
    return hpdl.is_initialized()


def world() -> Communicator:
    if not hpdl.is_initialized():
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return hpdl.world()


def size() -> int:
    return world().size


def rank() -> int:
    return world().rank


def local_rank() -> int:
    return world().local_rank


def local_size() -> int:
    return world().local_size


def cross_size() -> int:
    """Number of nodes (assumes the same number of ranks on every node, as Horovod does)."""
    comm = world()
    return comm.size // comm.local_size


def cross_rank() -> int:
    comm = world()
    return comm.rank // comm.local_size


def mpi_built() -> bool:
    return True


def gloo_built() -> bool:
    return torch.distributed.is_available()


def nccl_built() -> bool:
    return torch.cuda.is_available() and torch.distributed.is_nccl_available()


def mpi_threads_supported() -> bool:
    return False


def join(device: int = -1) -> int:
    """Horovod's join (uneven data) is not supported: give every rank the same number of steps."""
    raise NotImplementedError(
        "hpdl.horovod.join: uneven numbers of steps per rank are not supported; use a sampler that gives every "
        "rank the same number of batches (hpdl.train's distributed sampler does)"
    )


# --------------------------------------------------------------------------- collectives
_handles: dict[int, tuple[Work, Any]] = {}
_next_handle = itertools.count(1)


def _reduce(
    tensor: torch.Tensor,
    op: Any,
    average: Optional[bool],
    compression: Any,
    prescale_factor: float,
    postscale_factor: float,
) -> tuple[Work, Any]:
    """Start an in-place allreduce of `tensor`; return the handle and the finishing step."""
    if average is not None:
        op = Average if average else Sum
    reduce_op = check_op(Average if op is None else op)
    comm = world()
    wire_name = compression_name(compression)
    wire_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(wire_name or "")
    if prescale_factor != 1.0:
        tensor.mul_(prescale_factor)
    wire = tensor
    if wire_dtype is not None and tensor.dtype.is_floating_point and tensor.dtype != wire_dtype:
        wire = tensor.to(wire_dtype)
    work = comm.allreduce(wire, "sum" if reduce_op == "avg" else reduce_op, async_op=True)

    def finish() -> torch.Tensor:
        if wire is not tensor:
            tensor.copy_(wire)
        if reduce_op == "avg":
            tensor.div_(comm.size)
        if postscale_factor != 1.0:
            tensor.mul_(postscale_factor)
        return tensor

    return work, finish


def allreduce_async_(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
    compression: Any = Compression.none,
) -> int:
    """Start reducing `tensor` in place; `synchronize(handle)` returns it reduced."""
    work, finish = _reduce(tensor, op, average, compression, prescale_factor, postscale_factor)
    handle = next(_next_handle)
    _handles[handle] = (work, finish)
    return handle


def allreduce_async(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
    compression: Any = Compression.none,
) -> int:
    """Start reducing a copy of `tensor`; `synchronize(handle)` returns the reduced copy."""
    return allreduce_async_(
        tensor.detach().clone(), average, name, op, prescale_factor, postscale_factor, process_set, compression
    )


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None, **kwargs: Any) -> Any:
    return synchronize(allreduce_async_(tensor, average, name, **kwargs))


def allreduce(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Any:
    """The reduction of `tensor` across ranks, as a new tensor (default: the average)."""
    return synchronize(
        allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set, compression)
    )


def allgather(tensor: torch.Tensor, name: Optional[str] = None, process_set: Any = None) -> Any:
    """Every rank's tensor concatenated along dim 0 (dim 0 may differ between ranks)."""
    return world().allgather(tensor.detach().contiguous())


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: Any = None) -> int:
    work = world().broadcast(tensor, root_rank, async_op=True)
    handle = next(_next_handle)
    _handles[handle] = (work, lambda: tensor)
    return handle


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: Any = None) -> int:
    return broadcast_async_(tensor.detach().clone(), root_rank, name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: Any = None) -> Any:
    return synchronize(broadcast_async_(tensor, root_rank, name))


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: Any = None) -> Any:
    """`root_rank`'s tensor, as a new tensor on every rank."""
    return synchronize(broadcast_async(tensor, root_rank, name))


def poll(handle: int) -> bool:
    """Whether the operation behind `handle` has finished (does not wait)."""
    return _lookup(handle)[0].is_completed()


def synchronize(handle: int) -> Any:
    """Wait for the operation behind `handle` and return its result."""
    work, finish = _lookup(handle)
    work.wait()
    del _handles[handle]
    return finish()


def _lookup(handle: int) -> tuple[Work, Any]:
    try:
        return _handles[handle]
    except KeyError:
        raise ValueError(f"handle {handle!r} is unknown or was already synchronized") from None


# --------------------------------------------------------------------------- model and optimizer state
def broadcast_parameters(params: Union[dict, Any], root_rank: int) -> None:
    """Copy `root_rank`'s parameters (a state_dict or named_parameters()) into every rank's, in place."""
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    tensors = []
    for entry in items:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], torch.Tensor)):
            raise ValueError("broadcast_parameters takes a state_dict or named_parameters(), i.e. (name, tensor) pairs")
        tensors.append(entry[1].data)
    broadcast_tensors(world(), tensors, root=root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Make every rank's optimizer state (moments, step counts, hyperparameters) equal `root_rank`'s.

    Sent as one pickled object (the slow path: run once at start or after loading a checkpoint).
    """
    comm = world()
    state = comm.broadcast_object(optimizer.state_dict() if comm.rank == root_rank else None, root_rank)
    if comm.rank != root_rank:
        optimizer.load_state_dict(state)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None, process_set: Any = None) -> Any:
    return world().broadcast_object(obj, root_rank)


def allgather_object(obj: Any, name: Optional[str] = None, process_set: Any = None) -> list:
    return world().allgather_object(obj)
