"""The merge collectives of branch parallelism, as autograd functions whose backward is right.

Every rank of the branch group holds the same input and, after the merge,
the same output; what follows the block is computed on every rank alike,
so the gradient arriving at the merged output is the same on every rank.
Hence:

- concat: forward writes this rank's branch outputs into its own block of
  a flat buffer, gathers the others' blocks around it (one allgather-v in
  place) and puts the pieces in branch order; backward hands each of this
  rank's branches its slice of the output gradient (one copy each, no
  communication);
- sum / mean: forward allreduces the sum of this rank's branch outputs;
  backward passes the output gradient (divided by the branch count for
  mean) to the local sum unchanged (no communication);
- the block's input: forward is the identity; backward sums the input's
  gradient over the ranks (each rank's gradient covers only its branches).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from hpdl.comm.base import Communicator

__all__ = ["Layout", "gather_concat", "allreduce_sum", "sum_input_grad"]


class Layout:
    """Output shapes of every branch and who owns which: enough to cut the gathered buffer back into branches."""

    def __init__(
        self, shapes: Sequence[tuple[int, ...]], owner: Sequence[int], ranks: int, dim: int, dtype: torch.dtype
    ):
        self.shapes = [tuple(s) for s in shapes]
        self.dtype = dtype
        """Of the merged output: torch.cat's promotion over every branch's (on every rank)."""
        self.owner = list(owner)
        self.dim = dim
        self.per_rank = [[i for i, o in enumerate(owner) if o == r] for r in range(ranks)]
        self.numels = [int(torch.Size(s).numel()) for s in self.shapes]
        self.sizes = [sum(self.numels[i] for i in mine) for mine in self.per_rank]
        """Elements each rank contributes to the gather."""


class _GatherConcat(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, comm: Communicator, layout: Layout, rank: int, *outs: torch.Tensor) -> torch.Tensor:
        ctx.layout, ctx.rank = layout, rank
        # (a new buffer each call: a kept one would add the block's output to the peak memory of every step)
        gathered = torch.empty(sum(layout.sizes), dtype=layout.dtype, device=outs[0].device)
        start = sum(layout.sizes[:rank])
        mine = gathered[start : start + layout.sizes[rank]]
        at = 0
        for o in outs:  # (copy_ casts to the merged dtype where a branch's differs; cat with out= would not)
            mine[at : at + o.numel()].copy_(o.reshape(-1))
            at += o.numel()
        if comm.size > 1:
            comm.allgather(mine, sizes=layout.sizes, out=gathered)
        pieces: list = [None] * len(layout.shapes)
        offset = 0
        for owned in layout.per_rank:
            for i in owned:
                pieces[i] = gathered[offset : offset + layout.numels[i]].view(layout.shapes[i])
                offset += layout.numels[i]
        return torch.cat(pieces, dim=layout.dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        layout: Layout = ctx.layout
        widths = [shape[layout.dim] for shape in layout.shapes]
        parts = torch.split(grad, widths, dim=layout.dim)
        # One copy each: a convolution's backward given the strided slice itself took longer than the copy.
        return (None, None, None, *(parts[i].contiguous() for i in layout.per_rank[ctx.rank]))


def gather_concat(outs: Sequence[torch.Tensor], comm: Communicator, layout: Layout) -> torch.Tensor:
    """The concatenation of every branch's output along `layout.dim` (`outs`: this rank's branches' outputs, in
    branch order)."""
    return _GatherConcat.apply(comm, layout, comm.rank, *outs)


class _AllreduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, comm: Communicator, scale: float) -> torch.Tensor:
        ctx.scale = scale
        out = local.clone()
        if comm.size > 1:
            comm.allreduce(out, "sum")
        return out * scale if scale != 1.0 else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return (grad * ctx.scale if ctx.scale != 1.0 else grad), None, None


def allreduce_sum(local: torch.Tensor, comm: Communicator, scale: float = 1.0) -> torch.Tensor:
    """scale * (the sum over ranks of `local`); backward: the output gradient times scale, locally."""
    return _AllreduceSum.apply(local, comm, scale)


class _SumInputGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        total = grad.contiguous().clone()
        if ctx.comm.size > 1:
            ctx.comm.allreduce(total, "sum")
        return total, None


def sum_input_grad(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """`x` itself, whose gradient is summed over the ranks in backward."""
    return _SumInputGrad.apply(x, comm)
