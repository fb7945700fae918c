"""`Branches`: a block of independent branches written as a plain module, which a plan may spread over ranks.

    block = Branches([conv1x1, conv3x3, conv5x5, pool_proj], "concat")   # one process: merge of every branch

A model written with `Branches` runs as it is on one process; a
`hpdl.parallel.Plan` with tp > 1 replaces each such block (the style
"branch" of its `tp_plan`, which a model with `Branches` gets without
asking) by a `BranchParallel` over the mesh's tp group, whose output is
the same merge; the planner (`hpdl plan`) then weighs branch parallelism
beside data, pipeline and spatial parallelism. The block's meaning is
fixed by hpdl (its forward is exactly the merge), so replacing it cannot
change what the model computes.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Mapping, Sequence, Union

import torch
from torch import nn

from hpdl.comm.base import Communicator
from hpdl.parallel.branch.module import BranchParallel, checked_branches

__all__ = ["Branches", "BRANCH_STYLE", "branch_plan", "branch_problem", "nested_in_branches", "spread"]

BRANCH_STYLE = "branch"
"""The `tp_plan` style of a `Branches` block: its branches on the tp ranks, merged by one collective."""


class Branches(nn.Module):
    """`merge(branch_0(x), ..., branch_n-1(x))` in one process: concat along `dim` (in branch order), sum or mean."""

    def __init__(self, branches: Union[nn.ModuleList, Sequence[nn.Module]], merge: str, *, dim: int = 1):
        super().__init__()
        self.branches = nn.ModuleList(checked_branches(branches, merge, "Branches"))
        self.merge, self.dim = merge, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [branch(x) for branch in self.branches]
        if self.merge == "concat":
            return torch.cat(outs, self.dim)
        total = torch.stack(outs).sum(0)
        return total / len(outs) if self.merge == "mean" else total

    def extra_repr(self) -> str:
        return f"merge={self.merge!r}, branches={len(self.branches)}, dim={self.dim}"


def branch_problem(module: Any, ranks: int) -> str:
    """Why `module` cannot run branch-parallel over `ranks` ranks ('' when it can)."""
    if not isinstance(module, Branches):
        return (
            f"'{BRANCH_STYLE}' spreads an hpdl.parallel.branch.Branches block; this is a {type(module).__name__} "
            "(write the block as Branches(branches, merge))"
        )
    if len(module.branches) < ranks:
        return f"{len(module.branches)} branches for {ranks} ranks: every rank needs a branch"
    return ""


def branch_plan(model: nn.Module) -> dict[str, str]:
    """The `tp_plan` entries of every `Branches` block of `model` (outermost ones; none inside another)."""
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, Branches) and name and not any(name.startswith(f"{outer}.") for outer in plan):
            plan[name] = BRANCH_STYLE
    return plan


def nested_in_branches(model: nn.Module, tp_plan: Mapping[str, str]) -> list[str]:
    """Modules another style of `tp_plan` would split inside (or as) a block its "branch" style spreads: each
    tp rank holds other branches there, so a layer of one cannot also be split over the same ranks."""
    names = [name for name, _ in model.named_modules() if name]

    def named(branch: bool) -> list[str]:
        patterns = [p for p, style in tp_plan.items() if (style == BRANCH_STYLE) == branch]
        return [name for name in names if any(fnmatch.fnmatchcase(name, p) for p in patterns)]

    blocks = named(True)
    return [name for name in named(False) if any(name == b or name.startswith(f"{b}.") for b in blocks)]


def spread(block: Branches, comm: Communicator) -> BranchParallel:
    """The `BranchParallel` of `block` over `comm` (the same merge; branches placed by parameter count when
    their number differs from the ranks')."""
    return BranchParallel(block.branches, block.merge, comm, dim=block.dim).train(block.training)
