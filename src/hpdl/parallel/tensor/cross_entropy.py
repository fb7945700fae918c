"""Cross-entropy over logits whose vocabulary is split across the tp ranks, without gathering the logits.

Megatron-LM's vocab-parallel cross-entropy: with z the logits of one
position split as [z_0 | z_1 | ...] over the ranks,

    loss = log(sum_j exp(z_j - m)) - (z_target - m),  m = max_j z_j

Each rank reduces its slice: one allreduce (max) of m, one (sum) of the
exponentials and one (sum) of the target logit, each of one number per
position, so the full (positions x vocabulary) logits never exist on any
rank. Backward is local: softmax minus the one-hot target, on this rank's
slice.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from hpdl.comm.base import Communicator

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, comm: Communicator) -> torch.Tensor:
        width = logits.shape[-1]
        start = comm.rank * width
        z = logits.detach()
        m = z.max(dim=-1).values
        comm.allreduce(m, "max")
        shifted = z - m.unsqueeze(-1)
        outside = (target < start) | (target >= start + width)
        local_target = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), picked])  # one allreduce for both sums
        comm.allreduce(sums, "sum")
        total, picked = sums[0], sums[1]
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local_target, outside)
        return total.log() - picked

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local_target, outside = ctx.saved_tensors
        g = softmax.clone()
        inside = (~outside).to(g.dtype)
        g.scatter_add_(-1, local_target.unsqueeze(-1), -inside.unsqueeze(-1))
        return g * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, comm: Optional[Communicator] = None, *, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy of `logits` (..., vocab / tp: this rank's slice, rank order) against `target` (...) ids.

    Equals `F.cross_entropy(full_logits.reshape(-1, vocab), target.reshape(-1), reduction=...)`;
    every tp rank gets the same value. With `comm` None or of size 1 it is the plain cross-entropy.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction={reduction!r} must be 'mean', 'sum' or 'none'")
    if tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} must be target {tuple(target.shape)} plus "
            "a vocabulary dimension"
        )
    flat_logits, flat_target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    if comm is None or comm.size == 1:
        losses = F.cross_entropy(flat_logits, flat_target, reduction="none")
    else:
        losses = _VocabParallelCE.apply(flat_logits.contiguous(), flat_target, comm)
    if reduction == "none":
        return losses.reshape(target.shape)
    return losses.sum() if reduction == "sum" else losses.mean()
