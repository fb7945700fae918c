"""Cut a full tensor into this rank's slab, and put slabs back together (with gradients that flow back).

    x_local = shard(x, comm, dim=2)      # rows even_split(H, P)[rank] of x
    y_full = gather(y_local, comm, dim=2)

`gather` is differentiable: forward an allgather, backward this rank's
rows of the gradient (the code after it runs replicated, the same on every
rank, so each rank's gradient is already the whole gradient). `sum_over_slabs`
is the same pair for a sum (a loss summed over pixels): forward allreduce,
backward identity.
"""

from __future__ import annotations

from typing import Any

import torch

from hpdl.comm.base import Communicator
from hpdl.parallel.spatial.partition import even_split

__all__ = ["shard", "gather", "sum_over_slabs"]


def shard(x: torch.Tensor, comm: Communicator, dim: int = 2) -> torch.Tensor:
    """This rank's slab of `x` along `dim` (a contiguous copy; the first n % P ranks get one row more)."""
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"shard: dim={dim} is not a dimension of a tensor of shape {tuple(x.shape)}")
    n = x.shape[dim]
    if n < comm.size:
        raise ValueError(f"shard: {n} rows along dim {dim} cannot give each of {comm.size} ranks one")
    start, end = even_split(n, comm.size)[comm.rank]
    return x.narrow(dim, start, end - start).contiguous()


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        if comm.size == 1:
            return x.clone()
        counts = comm.allgather(torch.tensor([x.shape[dim]], dtype=torch.int64), sizes=[1] * comm.size).tolist()
        moved = x.movedim(dim, 0).contiguous()
        full = comm.allgather(moved, sizes=[int(c) for c in counts])
        ctx.start = int(sum(counts[: comm.rank]))
        ctx.rows = x.shape[dim]
        return full.movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.comm.size == 1:
            return grad, None, None
        return grad.narrow(ctx.dim, ctx.start, ctx.rows).contiguous(), None, None


def gather(x: torch.Tensor, comm: Communicator, dim: int = 2) -> torch.Tensor:
    """The full tensor from every rank's slab along `dim`, on every rank (differentiable)."""
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"gather: dim={dim} is not a dimension of a tensor of shape {tuple(x.shape)}")
    return _Gather.apply(x, comm, dim % x.dim())


class _SumOverSlabs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        if comm.size > 1:
            comm.allreduce(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_over_slabs(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Sum of every rank's `x` (for example per-slab loss sums), the same on every rank; backward passes through.

    The code after it must run the same on every rank (a replicated loss),
    so each rank's gradient is the whole gradient.
    """
    return _SumOverSlabs.apply(x, comm)
