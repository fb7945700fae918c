"""Memory formulas: ZeRO model states per device, pipeline in-flight micro-batches, the GPipe bubble.

Model states (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC'20, section 3): with Psi parameters
trained in mixed precision with Adam, each device holds 2 Psi bytes of 16-bit
parameters, 2 Psi of 16-bit gradients and K Psi = 12 Psi of optimizer state
(fp32 master parameters, momentum and variance). ZeRO over N data-parallel
ranks divides the optimizer state (stage 1), also the gradients (stage 2),
also the parameters (stage 3) by N:

    DP      (2 + 2 + K) Psi
    ZeRO-1  (2 + 2) Psi + K Psi / N
    ZeRO-2  2 Psi + (2 + K) Psi / N
    ZeRO-3  (2 + 2 + K) Psi / N

For Psi = 7.5e9, N = 64 these are 120, 31.4, 16.6 and 1.875 GB (the paper's
Figure 1).

The formulas themselves live beside the implementations, once:
`hpdl.parallel.zero_redundancy.memory_formula` (here with K folded into the optimizer
state and 16-bit gradient shards, the paper's accounting; the cost model
calls it with hpdl's own mixed precision) and
`hpdl.parallel.pipe.schedule.bubble_fraction`. They are imported on first
use: planning needs no torch until a model is measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

__all__ = [
    "PRECISIONS",
    "OPTIMIZERS",
    "StateBytes",
    "state_bytes",
    "ModelStates",
    "model_states",
    "bubble_fraction",
    "gems_bubble_fraction",
    "in_flight",
    "spatial_activation_bytes",
    "optimizer_traffic",
]

PRECISIONS = ("mixed", "fp32", "bf16")
"""mixed: 16-bit parameters and gradients with fp32 master copies (the ZeRO paper's setting);
fp32: everything in 32 bits; bf16: pure 16-bit training (optimizer state in 16 bits too)."""

OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-momentum")

_STATE_WORDS = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1}
"""Per-parameter state tensors of each optimizer (Adam: momentum and variance)."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each kind of model state."""

    param: int
    grad: int
    optimizer: int
    """K in the ZeRO paper: optimizer state, plus the fp32 master copy in mixed precision."""

    @property
    def total(self) -> int:
        return self.param + self.grad + self.optimizer


def state_bytes(optimizer: str, precision: str) -> StateBytes:
    """Bytes per parameter: (2, 2, 12) for mixed-precision Adam as in the ZeRO paper; (4, 4, 8) for fp32 Adam."""
    optimizer = optimizer.lower()
    if optimizer not in _STATE_WORDS:
        raise ValueError(f"unknown optimizer {optimizer!r}; the planner knows {', '.join(OPTIMIZERS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}")
    words = _STATE_WORDS[optimizer]
    if precision == "mixed":
        return StateBytes(2, 2, 4 + 4 * words)
    if precision == "fp32":
        return StateBytes(4, 4, 4 * words)
    return StateBytes(2, 2, 2 * words)


def optimizer_traffic(optimizer: str, precision: str) -> int:
    """Bytes the optimizer step reads and writes per parameter it updates (it is memory-bound).

    It reads the gradient and every state word and writes them back except
    the gradient: grad + 2 * (optimizer state + parameter).
    """
    b = state_bytes(optimizer, precision)
    return b.grad + 2 * (b.optimizer + b.param)


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes per device, by kind."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_states(params: float, dp: int, stage: int, optimizer: str = "adam", precision: str = "mixed") -> ModelStates:
    """Per-device model-state bytes of `params` parameters under ZeRO `stage` (0 = plain DP) over `dp` ranks."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage!r}: use 0 (plain data parallel), 1, 2 or 3")
    if dp < 1:
        raise ValueError(f"dp = {dp!r}: the data-parallel degree is at least 1")
    from hpdl.parallel.zero_redundancy import memory_formula  # lazy: `hpdl plan` starts without the strategies

    b = state_bytes(optimizer, precision)
    # the paper's accounting: K (master copy included) as optimizer state, gradient shards as wide as the gradients
    parts = memory_formula(stage, params, dp, param_bytes=b.param, state_bytes=b.optimizer)
    return ModelStates(params=parts["params"], grads=parts["grads"], optimizer=parts["optimizer"])


def bubble_fraction(stages: int, micro_batches: int) -> Fraction:
    """GPipe's idle share of a pipelined step with equal stages: (p - 1) / (m + p - 1), exactly.

    Huang et al., "GPipe", NeurIPS 2019: each of p stages waits p - 1 slots
    while m micro-batches fill and drain the pipe. 1F1B has the same bubble.
    """
    from hpdl.parallel.pipe.schedule import bubble_fraction as schedule_bubble  # lazy: start-up time

    if stages < 1 or micro_batches < 1:
        raise ValueError(f"bubble of p={stages}, m={micro_batches}: both must be >= 1")
    # the pipeline's float, made exact again: its denominator divides m + p - 1, and any two fractions with such
    # denominators differ by far more than the float's rounding
    return Fraction(schedule_bubble(stages, micro_batches)).limit_denominator(micro_batches + stages - 1)


def in_flight(schedule: str, stages: int, micro_batches: int, stage: int = 0) -> int:
    """Micro-batches whose activations stage `stage` holds at its peak.

    GPipe runs every forward before any backward: all m. 1F1B (PipeDream-
    Flush, Narayanan et al. 2021) starts backward as soon as the last stage
    can, so stage s holds at most p - s (stage 0: p), never more than m.
    """
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(stages - stage, micro_batches)
    if schedule == "gems":  # both replicas together, counted on the schedule (hpdl.parallel.pipe.gems_schedule)
        from hpdl.parallel.pipe.gems_schedule import GemsSchedule

        return GemsSchedule(stages, micro_batches).peak_live(stage)
    raise ValueError(f"unknown schedule {schedule!r}; use 'gpipe', '1f1b' or 'gems'")


def gems_bubble_fraction(stages: int, micro_batches: int) -> float:
    """GEMS-MASTER's idle share of a step with equal stages: 0 on 2 ranks, counted on its schedule's grid otherwise."""
    from hpdl.parallel.pipe.gems_schedule import gems_bubble

    return gems_bubble(stages, micro_batches)


def spatial_activation_bytes(whole_bytes: float, parts: int, halo_bytes: float = 0.0) -> float:
    """Activation bytes per rank of a spatial split in `parts` slabs: 1/parts of one process's, plus the halos
    it receives (`hpdl.parallel.spatial.cost.spatial_estimate` counts them from the model's own windows)."""
    if parts < 1:
        raise ValueError(f"spatial_activation_bytes: parts={parts} must be at least 1")
    return whole_bytes / parts + halo_bytes
