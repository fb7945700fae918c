"""What ZeRO-3 costs inside a hybrid layout, per rank: memory of one pipeline stage and its collectives per step.

The planner (`hpdl.plan`) calls these with one stage's parameter count
(already divided by tp: each tp slice is sharded over dp) so that its cost
model and memory formulas follow what `hpdl.parallel.zero` does on a mesh:

- a pipeline stage runs `micro_batches` forwards and backwards; gradients
  accumulate in full (`no_sync`) and are reduce-scattered once per step,
  after the last micro-batch, so the stage holds a full gradient while the
  step runs, as ZeRO-2 does in a pipeline;
- `reshard_after_forward=True` gathers every unit for each micro-batch's
  forward and again for its backward (2m all-gathers per unit per step) and
  holds at most a unit and its prefetched neighbour; False gathers each unit
  once per step and holds the whole stage's parameters during the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpdl.parallel.zero_redundancy.wrap import memory_formula

__all__ = ["Stage3Traffic", "stage3_memory", "stage3_traffic"]


@dataclass(frozen=True)
class Stage3Traffic:
    """Collectives of one stage's ZeRO-3 in one step, over its dp group (bytes are full, unsharded sizes)."""

    allgathers: int
    """All-gathers of parameter units per step."""
    allgather_bytes: float
    """Full (gathered) bytes of one unit: each all-gather moves (dp - 1) / dp of it into every rank."""
    reduce_scatters: int
    """Reduce-scatters of gradient units per step (one per unit: after the last micro-batch)."""
    reduce_scatter_bytes: float
    """Full gradient bytes of one unit."""
    exposed_gathers: int
    """Gathers that nothing can hide: the first unit of the step (and of each micro-batch when resharding)."""


def stage3_traffic(
    stage_numel: float,
    units: int,
    micro_batches: int,
    *,
    reshard_after_forward: bool = True,
    param_bytes: int = 4,
    grad_bytes: int = 4,
) -> Stage3Traffic:
    """The all-gathers and reduce-scatters of a stage of `stage_numel` parameters in `units` units per step.

    Time them with the planner's collective model over the dp group
    (`coll.allgather(cl, dp_group, allgather_bytes)` each), with prefetch
    hiding them behind the micro-batches' compute except `exposed_gathers`.
    """
    if units < 1 or micro_batches < 1:
        raise ValueError(f"units={units} and micro_batches={micro_batches} must be at least 1")
    per_unit = float(stage_numel) / units
    gathers = units * (2 * micro_batches if reshard_after_forward else 1)
    return Stage3Traffic(
        allgathers=gathers,
        allgather_bytes=per_unit * param_bytes,
        reduce_scatters=units,
        reduce_scatter_bytes=per_unit * grad_bytes,
        exposed_gathers=micro_batches if reshard_after_forward else 1,
    )


def stage3_memory(
    stage_numel: float,
    dp: int,
    *,
    micro_batches: int = 1,
    largest_unit_numel: float = 0.0,
    second_unit_numel: float = 0.0,
    reshard_after_forward: bool = True,
    param_bytes: int = 4,
    state_bytes: int = 8,
    mixed_precision: bool = False,
) -> dict[str, float]:
    """Peak bytes per rank of one stage's model state under ZeRO-3 over `dp` ranks (`memory_formula`'s parts).

    `micro_batches` > 1 (a pipeline, or `no_sync` accumulation): the full
    gradient of the stage accumulates until the step's reduce-scatter
    (gradient bytes in the compute dtype, plus the fp32 shard). Gathered
    parameters: with `reshard_after_forward`, the largest unit and the one
    prefetched beside it; without, the whole stage.
    """
    if dp < 1:
        raise ValueError(f"dp={dp} must be at least 1")
    if reshard_after_forward:
        gathered = (largest_unit_numel + second_unit_numel) * param_bytes
    else:
        gathered = float(stage_numel) * param_bytes
    parts = memory_formula(
        3,
        stage_numel,
        dp,
        param_bytes=param_bytes,
        state_bytes=state_bytes,
        mixed_precision=mixed_precision,
        gathered_bytes=int(gathered),
    )
    if micro_batches > 1:
        parts["grads"] += float(stage_numel) * param_bytes
    parts["total"] = parts["params"] + parts["grads"] + parts["optimizer"]
    return parts
