"""Horovod's SyncBatchNorm: batch normalisation whose statistics cover the whole global batch.

In training, each rank's per-channel count, sum and (after the global mean)
sum of squared deviations are allreduced, so every rank normalises with the
statistics of the concatenated batch; the backward pass falls out of
autograd through the differentiable `hvd.allreduce` (its gradient is the
allreduce of the gradient), which gives the exact gradient of the global
batch norm. Running statistics are updated with the global (unbiased)
variance, as torch's BatchNorm on the whole batch would.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from hpdl.horovod import ops
from hpdl.horovod.basics import Sum
from hpdl.horovod.process_sets import global_process_set

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Drop-in for torch.nn.BatchNorm1d/2d/3d (any input of shape N, C, ...) that syncs statistics."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_set: Any = global_process_set,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if self.training and self.track_running_stats:
            assert self.num_batches_tracked is not None
            self.num_batches_tracked.add_(1)
        if not self.training:
            return super().forward(input)
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        shape = [1, channels] + [1] * (input.dim() - 2)
        count = torch.tensor([input.numel() // channels], dtype=input.dtype)
        local_sum = input.sum(dim=dims)
        totals = ops.allreduce(torch.cat([local_sum, count]), op=Sum, name=None, process_set=self.process_set)
        n = totals[channels].detach()
        mean = totals[:channels] / n
        centered = input - mean.view(shape)
        sq = ops.allreduce((centered * centered).sum(dim=dims), op=Sum, process_set=self.process_set)
        var = sq / n
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            momentum = self.momentum
            if momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)  # type: ignore[arg-type]
            with torch.no_grad():
                unbiased = var * (n / max(float(n) - 1, 1.0))
                self.running_mean.mul_(1 - momentum).add_(mean.detach() * momentum)
                self.running_var.mul_(1 - momentum).add_(unbiased.detach() * momentum)
        return out
