"""Learning rates for large global batches: the linear scaling rule with a gradual warm-up.

Goyal et al. 2017 ("Accurate, Large Minibatch SGD: Training ImageNet in 1
Hour", arXiv:1706.02677): when the global batch grows k-fold (more ranks,
same per-rank batch), multiply the learning rate by k; because the large
rate diverges in the first steps, start from the small-batch rate and ramp
linearly to the scaled one over the first few epochs (they use 5).
"""

from __future__ import annotations

import math
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["linear_scaled_lr", "WarmupSchedule"]

DECAYS = ("constant", "cosine", "linear")


def linear_scaled_lr(base_lr: float, global_batch: int, reference_batch: int = 256) -> float:
    """`base_lr` (tuned for `reference_batch` samples a step) scaled to `global_batch`: base_lr * global / reference."""
    if base_lr <= 0 or global_batch <= 0 or reference_batch <= 0:
        raise ValueError(
            f"linear_scaled_lr: base_lr={base_lr}, global_batch={global_batch} and reference_batch={reference_batch} "
            "must all be positive"
        )
    return base_lr * global_batch / reference_batch


class WarmupSchedule(LRScheduler):
    """Linear warm-up from `start_factor` x lr to lr over `warmup_steps`, then constant, cosine or linear decay.

    Step it once per optimizer step (not per epoch). The factor at step s is

        start_factor + (1 - start_factor) * s / warmup_steps          for s < warmup_steps
        1                                                             (decay="constant")
        0.5 * (1 + cos(pi * p)) or 1 - p, p = (s - warmup) / (total - warmup)   (cosine / linear, needs total_steps)

    With the linear scaling rule, set the optimizer's lr to the scaled rate and
    `start_factor = reference_batch / global_batch`, so training starts at the
    small-batch rate (`WarmupSchedule.for_scaling` does both).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_steps: int,
        *,
        start_factor: float = 0.0,
        total_steps: int = 0,
        decay: str = "constant",
        min_factor: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"WarmupSchedule: warmup_steps={warmup_steps} must be >= 0")
        if not 0.0 <= start_factor <= 1.0 or not 0.0 <= min_factor <= 1.0:
            raise ValueError(
                f"WarmupSchedule: start_factor={start_factor} and min_factor={min_factor} must be in [0, 1]"
            )
        if decay not in DECAYS:
            raise ValueError(f"WarmupSchedule: decay={decay!r}; choose one of {', '.join(DECAYS)}")
        if decay != "constant" and total_steps <= warmup_steps:
            raise ValueError(
                f"WarmupSchedule: decay={decay!r} needs total_steps ({total_steps}) > warmup_steps ({warmup_steps})"
            )
        self.warmup_steps = int(warmup_steps)
        self.start_factor = float(start_factor)
        self.total_steps = int(total_steps)
        self.decay = decay
        self.min_factor = float(min_factor)
        super().__init__(optimizer, last_epoch)

    @classmethod
    def for_scaling(
        cls,
        optimizer: Optimizer,
        *,
        global_batch: int,
        reference_batch: int,
        warmup_steps: int,
        total_steps: int = 0,
        decay: str = "constant",
    ) -> WarmupSchedule:
        """Set every group's lr to its value scaled by the linear rule, and warm up from the unscaled value."""
        factor = global_batch / reference_batch
        for group in optimizer.param_groups:
            group["lr"] = linear_scaled_lr(group["lr"], global_batch, reference_batch)
            group.pop("initial_lr", None)
        return cls(
            optimizer,
            warmup_steps,
            start_factor=min(1.0, 1.0 / factor),
            total_steps=total_steps,
            decay=decay,
        )

    def factor(self, step: int) -> float:
        """The multiplier of the base lr after `step` optimizer steps."""
        if step < self.warmup_steps:
            return self.start_factor + (1.0 - self.start_factor) * step / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.decay == "cosine" else 1.0 - progress
        return self.min_factor + (1.0 - self.min_factor) * shape

    def get_lr(self) -> list[float]:  # type: ignore[override]
        step = max(0, self.last_epoch)
        return [float(base) * self.factor(step) for base in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}
