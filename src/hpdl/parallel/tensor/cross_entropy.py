"""Cross-entropy over logits whose vocabulary is split across the tp ranks, without gathering the logits.

Megatron-LM's vocab-parallel cross-entropy: with z the logits of one
position split as [z_0 | z_1 | ...] over the ranks,

    loss = log(sum_j exp(z_j - m)) - (z_target - m),  m = max_j z_j

Each rank reduces its slice: one allreduce (max) of m, one (sum) of the
exponentials and one (sum) of the target logit, each of one number per
position, so the full (positions x vocabulary) logits never exist on any
rank. Backward is local: softmax minus the one-hot target, on this rank's
slice. Targets equal to `ignore_index` (padding) are left out, as in
`F.cross_entropy`.
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
    logits: torch.Tensor,
    target: torch.Tensor,
    comm: Optional[Communicator] = None,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
) -> torch.Tensor:
    """Cross-entropy of `logits` (..., vocab / tp: this rank's slice, rank order) against `target` (...) ids.

    Equals `F.cross_entropy(full_logits.reshape(-1, vocab), target.reshape(-1), reduction=...,
    ignore_index=...)`: positions whose target is `ignore_index` (padding) add nothing and get no
    gradient, and "mean" divides by the number of the other positions (NaN when every target is
    ignored, as in torch). Every tp rank gets the same value. With `comm` None or of size 1 it is
    the plain cross-entropy. Target ids outside 0..vocab-1 (other than `ignore_index`) raise
    ValueError.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction={reduction!r} must be 'mean', 'sum' or 'none'")
    if tuple(logits.shape[:-1]) != tuple(target.shape):
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} must be target {tuple(target.shape)} plus "
            "a vocabulary dimension"
        )
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(
            f"vocab_parallel_cross_entropy: target must hold integer class ids (torch.long), got {target.dtype}"
        )
    ranks = comm.size if comm is not None else 1
    vocab = logits.shape[-1] * ranks
    flat_logits, flat_target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1).long()
    ignored = flat_target == ignore_index
    bad = ~ignored & ((flat_target < 0) | (flat_target >= vocab))
    if bool(bad.any()):
        first = int(flat_target[bad][0])
        raise ValueError(
            f"vocab_parallel_cross_entropy: target id {first} is outside the vocabulary 0..{vocab - 1} "
            f"({int(bad.sum())} such targets); mark padding with ignore_index={ignore_index}"
        )
    if comm is None or ranks == 1:
        losses = F.cross_entropy(flat_logits, flat_target, reduction="none", ignore_index=ignore_index)
    else:
        safe = flat_target.masked_fill(ignored, 0)  # any id in range; its loss is dropped below
        losses = _VocabParallelCE.apply(flat_logits.contiguous(), safe, comm).masked_fill(ignored, 0.0)
    if reduction == "none":
        return losses.reshape(target.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (~ignored).sum().to(losses.dtype)
