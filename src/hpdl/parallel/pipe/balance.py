"""Balance: measure each layer's time and memory on one micro-batch, and cut the layers into stages.

`partition(costs, stages)` finds the contiguous split that minimises the
slowest stage (the linear partition problem, solved exactly by dynamic
programming in O(L^2 p)); ties go to the split with the smaller largest
memory, and a memory cap per stage can rule splits out. `measure(layers,
sample)` times forward + backward of each layer in turn, building a layer
from its factory only while it is measured, so a model that fits on no
single rank can still be balanced.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from hpdl.parallel.pipe import microbatch
from hpdl.parallel.pipe.errors import BalanceError
from hpdl.parallel.pipe.memory import ActivationMeter

__all__ = ["LayerCost", "partition", "measure", "even", "check_balance"]

LayerSpec = Union[nn.Module, Callable[[], nn.Module]]


@dataclass(frozen=True)
class LayerCost:
    """Seconds of forward + backward on one micro-batch, and bytes (parameters, gradients, saved activations)."""

    seconds: float
    memory: int


def even(layers: int, stages: int) -> list[int]:
    """Layer counts as equal as possible (the first stages take one more)."""
    check_stages(layers, stages)
    base, extra = divmod(layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def check_stages(layers: int, stages: int) -> None:
    if layers < stages:
        raise BalanceError(
            f"{layers} layers cannot fill {stages} stages (one layer at least per stage): use fewer ranks in the "
            "pipeline, or split the model into more layers"
        )


def check_balance(balance: Sequence[int], layers: int, stages: int) -> list[int]:
    """A user's balance, checked against the model and the number of stages."""
    counts = list(balance)
    if len(counts) != stages or any(not isinstance(c, int) or c < 1 for c in counts) or sum(counts) != layers:
        raise BalanceError(
            f"balance={counts} does not fit: it needs {stages} positive layer counts (one per rank of the "
            f"pipeline) that add up to the model's {layers} layers, for example balance={even(layers, stages)} "
            "or balance='auto'"
        )
    return counts


def partition(
    costs: Sequence[float],
    stages: int,
    memory: Optional[Sequence[float]] = None,
    max_memory: Optional[float] = None,
) -> list[int]:
    """Layer counts per stage minimising the largest stage cost (then the largest stage memory)."""
    n = len(costs)
    check_stages(n, stages)
    mem = list(memory) if memory is not None else [0.0] * n
    prefix, mprefix = [0.0], [0.0]
    for c, b in zip(costs, mem):
        prefix.append(prefix[-1] + float(c))
        mprefix.append(mprefix[-1] + float(b))
    inf = (float("inf"), float("inf"))
    # best[s][j]: (max cost, max memory) of the first j layers in s stages; cut[s][j]: where the last stage starts
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf:
                    continue
                stage_mem = mprefix[j] - mprefix[i]
                if max_memory is not None and stage_mem > max_memory:
                    continue
                candidate = (max(best[s - 1][i][0], prefix[j] - prefix[i]), max(best[s - 1][i][1], stage_mem))
                if candidate < best[s][j]:
                    best[s][j], cut[s][j] = candidate, i
    if best[stages][n] == inf:
        raise BalanceError(
            f"no split of {n} layers into {stages} stages keeps every stage under max_memory={max_memory} bytes; "
            "use more stages or allow more memory"
        )
    counts, j = [], n
    for s in range(stages, 0, -1):
        i = cut[s][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def build(layer: LayerSpec, index: int, seed: Optional[int]) -> nn.Module:
    """The layer itself, or the factory's product (under `seed + index` when a seed is given)."""
    if isinstance(layer, nn.Module):
        return layer
    if seed is None:
        built = layer()
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + index)
            built = layer()
    if not isinstance(built, nn.Module):
        raise TypeError(f"layer factory {index} returned {type(built).__name__}, not an nn.Module")
    return built


def measure(
    layers: Sequence[LayerSpec], sample: Any, *, repeats: int = 3, sweeps: int = 3, seed: Optional[int] = None
) -> list[LayerCost]:
    """Time forward + backward of each layer on `sample` (one micro-batch of the first stage's input).

    Modules are measured on a copy (their gradients and buffers stay
    untouched); factories are built for the measurement and dropped. Each
    layer keeps its fastest of `repeats` runs after one warm-up, over
    `sweeps` passes through the whole model: other work that slows the
    machine for a while then has to hit the same layer in every pass to skew
    the split (with one pass, a busy moment inflated one layer's every run; with two, a CI run under load
    once gave four equal layers the split [1, 7] instead of [2, 6]).
    """
    seconds = [float("inf")] * len(layers)
    memory = [0] * len(layers)
    for _ in range(sweeps):
        x: Any = sample
        for index, spec in enumerate(layers):
            fastest, size, x = _time_layer(spec, index, x, repeats, seed)
            seconds[index] = min(seconds[index], fastest)
            memory[index] = max(memory[index], size)
    return [LayerCost(t, m) for t, m in zip(seconds, memory)]


def _time_layer(spec: LayerSpec, index: int, x: Any, repeats: int, seed: Optional[int]) -> tuple[float, int, Any]:
    """The fastest of `repeats` forward + backward runs, the layer's bytes, and its (detached) output."""
    with torch.random.fork_rng(devices=[]):
        layer = copy.deepcopy(spec) if isinstance(spec, nn.Module) else build(spec, index, seed)
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        times, saved, out = [], 0, None
        for r in range(repeats + 1):
            inputs = tuple(
                t.detach().requires_grad_(t.dtype.is_floating_point) for t in microbatch.as_tensors(x, "sample")
            )
            arg = inputs[0] if isinstance(x, torch.Tensor) else inputs
            start = time.perf_counter()
            with ActivationMeter(exclude=layer.parameters()) as meter:
                out = layer(arg)
            outs = [t for t in microbatch.as_tensors(out, f"layer {index}'s output") if t.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            if r:
                times.append(time.perf_counter() - start)
            saved = max(saved, meter.peak)
            layer.zero_grad(set_to_none=True)
    detached = out.detach() if isinstance(out, torch.Tensor) else tuple(t.detach() for t in out)  # type: ignore[union-attr]
    return min(times), 2 * params + saved, detached
