"""Where each branch runs: costs (measured, or parameter counts) and a balanced assignment to ranks.

`assign(costs, ranks)` is the longest-processing-time rule: branches in
decreasing cost, each to the rank with the least load so far (ties: fewer
branches, then the lower rank). It is deterministic, so every rank that
has the same costs computes the same placement; measured costs are averaged
over the ranks first (`BranchParallel` does this), so they agree.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

__all__ = ["BranchCost", "assign", "measure", "parameter_costs", "loads", "place"]


@dataclass(frozen=True)
class BranchCost:
    """Seconds of forward + backward of one branch on the sample (the fastest of a few runs)."""

    seconds: float


def assign(costs: Sequence[float], ranks: int) -> list[int]:
    """The rank of each branch: longest first, onto the least loaded rank; every rank gets at least one branch."""
    if ranks < 1:
        raise ValueError(f"ranks={ranks} must be positive")
    if len(costs) < ranks:
        raise ValueError(
            f"{len(costs)} branches cannot keep {ranks} ranks busy (every rank must own a branch, or the input "
            "gradient's sum would wait for a rank with nothing to do): use a group of at most "
            f"{len(costs)} ranks (comm.split) or a block with more branches"
        )
    order = sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i))
    load = [0.0] * ranks
    count = [0] * ranks
    owner = [0] * len(costs)
    for i in order:
        rank = min(range(ranks), key=lambda r: (load[r], count[r], r))
        owner[i] = rank
        load[rank] += float(costs[i])
        count[rank] += 1
    return owner


def place(costs: Sequence[float], ranks: int) -> list[int]:
    """One branch per rank in order when they are as many, else `assign` (what `BranchParallel` does without an
    explicit placement; the planner prices the same placement)."""
    return list(range(ranks)) if len(costs) == ranks else assign(costs, ranks)


def loads(costs: Sequence[float], owner: Sequence[int], ranks: int) -> list[float]:
    """The summed cost per rank of a placement."""
    out = [0.0] * ranks
    for cost, rank in zip(costs, owner):
        out[rank] += float(cost)
    return out


def parameter_costs(branches: Sequence[nn.Module]) -> list[float]:
    """A cost proxy without a sample: each branch's parameter count (at least 1)."""
    return [float(max(1, sum(p.numel() for p in b.parameters()))) for b in branches]


def measure(branches: Sequence[nn.Module], sample: torch.Tensor, repeats: int = 3) -> list[BranchCost]:
    """Time forward + backward of each branch on `sample` (on a copy; the fastest of `repeats` after a warm-up)."""
    costs = []
    for branch in branches:
        with torch.random.fork_rng(devices=[]):
            trial = copy.deepcopy(branch)
            times = []
            for r in range(repeats + 1):
                x = sample.detach().requires_grad_(sample.dtype.is_floating_point)
                start = time.perf_counter()
                out = trial(x)
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.backward(torch.ones_like(out))
                if r:
                    times.append(time.perf_counter() - start)
        costs.append(BranchCost(min(times)))
    return costs
