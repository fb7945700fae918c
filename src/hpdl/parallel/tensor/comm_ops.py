"""The autograd functions that connect tensor-parallel layers (Megatron-LM, Shoeybi et al. 2019, section 3).

    copy_to_tp      "f": identity in forward, allreduce of the gradient in backward (before a column layer)
    reduce_from_tp  "g": allreduce in forward, identity in backward (after a row layer)
    gather_from_tp  allgather along a dim (the last by default) in forward, this rank's slice of the gradient back

A column-parallel layer followed by a row-parallel one costs one allreduce
in forward (g) and one in backward (f) for the pair. Each function takes
the tp `Communicator`; with one rank they are the identity.
"""

from __future__ import annotations

from typing import Any

import torch

from hpdl.comm.base import Communicator

__all__ = ["copy_to_tp", "reduce_from_tp", "gather_from_tp", "allreduce_tp"]


def allreduce_tp(tensor: torch.Tensor, comm: Communicator, op: str = "sum") -> torch.Tensor:
    """Allreduce a contiguous copy of `tensor` over `comm` and return it (the input is left alone)."""
    out = tensor.clone(memory_format=torch.contiguous_format)
    if comm.size > 1:
        comm.allreduce(out, op)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return allreduce_tp(grad, ctx.comm), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        return allreduce_tp(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        ctx.width = x.shape[dim]
        # allgather concatenates along dim 0: move `dim` first, gather, move it back
        moved = x.movedim(dim, 0).contiguous()
        gathered = comm.allgather(moved, sizes=[moved.shape[0]] * comm.size)
        return gathered.movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        start = ctx.comm.rank * ctx.width
        return grad.narrow(ctx.dim, start, ctx.width).contiguous(), None, None


def copy_to_tp(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Identity forward; the gradient is summed over the tp ranks in backward ("f")."""
    return x if comm.size == 1 else _CopyToTP.apply(x, comm)


def reduce_from_tp(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Sum of the tp ranks' partial results in forward; identity backward ("g")."""
    return x if comm.size == 1 else _ReduceFromTP.apply(x, comm)


def gather_from_tp(x: torch.Tensor, comm: Communicator, dim: int = -1) -> torch.Tensor:
    """Concatenate the tp ranks' slices along `dim` (rank order) in forward; this rank's slice of the gradient back."""
    return x if comm.size == 1 else _GatherFromTP.apply(x, comm, dim % x.dim())
