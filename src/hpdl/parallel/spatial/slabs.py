"""Cut a full tensor into this rank's slab, and put slabs back together (with gradients that flow back).

    x_local = shard(x, comm, dim=2)      # rows even_split(H, P)[rank] of x
    y_full = gather(y_local, comm, dim=2)
    x_block = shard(x, comm, dim=(2, 3), grid=(2, 2))   # a 2-D split: this rank's block of a 2 x 2 grid

`gather` is differentiable: forward an allgather, backward this rank's
rows of the gradient (the code after it runs replicated, the same on every
rank, so each rank's gradient is already the whole gradient). `sum_over_slabs`
is the same pair for a sum (a loss summed over pixels): forward allreduce,
backward identity.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import torch

from hpdl.comm.base import Communicator
from hpdl.parallel.spatial.grid import coordinates, normalize_split
from hpdl.parallel.spatial.partition import even_split

__all__ = ["shard", "gather", "sum_over_slabs"]


def shard(
    x: torch.Tensor, comm: Communicator, dim: Union[int, Sequence[int]] = 2, grid: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """This rank's slab of `x` along `dim` (a contiguous copy; the first n % P ranks get one row more).

    With a tuple `dim` the ranks sit on `grid` (default: the most even one, e.g. 2 x 2 for 4 ranks),
    row-major, and each gets the even split of every dimension at its grid coordinate.
    """
    dims: tuple[int, ...] = (dim,) if isinstance(dim, int) else tuple(dim)
    for d in dims:
        if not -x.dim() <= d < x.dim():
            raise ValueError(f"shard: dim={d} is not a dimension of a tensor of shape {tuple(x.shape)}")
    parts: tuple[int, ...] = (comm.size,)
    if isinstance(dim, int):
        dims = (dim % x.dim(),)
    else:
        dims, parts = normalize_split(tuple(d % x.dim() for d in dims), grid, comm.size, "shard")
    for d, p, c in zip(dims, parts, coordinates(comm.rank, parts)):
        n = x.shape[d]
        if n < p:
            raise ValueError(f"shard: {n} rows along dim {d} cannot give each of {p} ranks one")
        start, end = even_split(n, p)[c]
        x = x.narrow(d, start, end - start)
    return x.contiguous()


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


class _GatherBlocks(torch.autograd.Function):
    """The blocks of a grid put together: one allgather of every rank's flattened block over the whole group."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dims: tuple, grid: tuple) -> torch.Tensor:
        mine = torch.tensor([[x.shape[d] for d in dims]], dtype=torch.int64)
        extents = comm.allgather(mine, sizes=[1] * comm.size).tolist()
        full_shape = list(x.shape)
        for axis, d in enumerate(dims):  # the ranks at coordinate 0 of every other axis span this one
            full_shape[d] = sum(
                extents[r][axis] for r in range(comm.size) if all(
                    c == 0 for i, c in enumerate(coordinates(r, grid)) if i != axis
                )
            )  # fmt: skip
        rest = math.prod(n for i, n in enumerate(x.shape) if i not in dims)
        numels = [rest * math.prod(e) for e in extents]
        flat = comm.allgather(x.contiguous().view(-1), sizes=numels)
        out = x.new_empty(full_shape)
        offset = 0
        for r, numel in enumerate(numels):
            block_shape, region, placed = list(x.shape), out, []
            for axis, (d, c) in enumerate(zip(dims, coordinates(r, grid))):
                block_shape[d] = extents[r][axis]
                start = even_split(full_shape[d], grid[axis])[c][0]
                region = region.narrow(d, start, extents[r][axis])
                placed.append((d, start, extents[r][axis]))
            region.copy_(flat[offset : offset + numel].view(block_shape))
            offset += numel
            if r == comm.rank:
                ctx.placed = placed
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        for d, start, rows in ctx.placed:  # this rank's block of the (replicated) gradient
            grad = grad.narrow(d, start, rows)
        return grad.contiguous(), None, None, None


def gather(
    x: torch.Tensor, comm: Communicator, dim: Union[int, Sequence[int]] = 2, grid: Optional[Sequence[int]] = None
) -> torch.Tensor:
    """The full tensor from every rank's slab along `dim`, on every rank (differentiable).

    A tuple `dim` puts together the blocks of a grid split (the same `dim` and `grid` as `shard`).
    """
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    for d in dims:
        if not -x.dim() <= d < x.dim():
            raise ValueError(f"gather: dim={d} is not a dimension of a tensor of shape {tuple(x.shape)}")
    if isinstance(dim, int):
        return _Gather.apply(x, comm, dim % x.dim())
    dims, parts = normalize_split(tuple(d % x.dim() for d in dims), grid, comm.size, "gather")
    if comm.size == 1:
        return x.clone()
    return _GatherBlocks.apply(x, comm, dims, parts)


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
