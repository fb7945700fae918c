"""Sub-graph (branch) parallelism (SUPER, Jain et al., IPDPS 2021): a block's independent branches on different ranks.

    block = BranchParallel([conv1x1, conv3x3, conv5x5, pool_proj], "concat", comm, sample=x[:4])
    y = block(x)   # every rank: the same x in, the same merged y out

Each rank runs only the branches placed on it (`placement`: balanced by
measured cost when the branches do not divide among the ranks); the outputs
are merged by one collective (concat: an allgather-v whose backward slices
this rank's part; sum / mean: an allreduce whose backward is the identity),
and the gradient of the block's input is summed over the ranks in backward.
Parts: `placement` (costs and the assignment), `merge` (the collectives as
autograd functions), `module` (`BranchParallel`), `block` (`Branches`, the
plain block a model is written with, which a `Plan` with tp > 1 spreads).
"""

from __future__ import annotations

from hpdl.parallel.branch.block import BRANCH_STYLE, Branches, branch_plan, branch_problem, spread
from hpdl.parallel.branch.module import MERGES, BranchParallel
from hpdl.parallel.branch.placement import BranchCost, assign, measure

__all__ = [
    "BranchParallel",
    "Branches",
    "MERGES",
    "BRANCH_STYLE",
    "BranchCost",
    "assign",
    "branch_plan",
    "branch_problem",
    "measure",
    "spread",
]
