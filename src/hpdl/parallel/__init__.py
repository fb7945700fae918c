"""Parallel strategies that wrap a plain `torch.nn.Module`: data, ZeRO, pipeline and tensor parallelism, and the mesh.

One package per strategy, each importing only what sits below it:

    shared            global-norm clipping, the wrapping optimizer's state, a mesh's groups (below everything)
    data              DataParallel and its gradient buckets
    tensor            column/row-parallel layers, vocabulary-parallel embedding and loss, parallelize
    pipe              Pipeline, its schedules, balance, links and engine
    zero_redundancy   zero(): ZeRO stages 1-3 (stage 3's prefetch is zero_redundancy/stage3.py)
    mesh              Mesh, Plan, build (on top: it composes the others)

The strategies are imported on first use (`hpdl.parallel.Pipeline` loads
`pipe` only), so that `import hpdl.parallel` stays cheap and one strategy's
dependencies never slow another's start. No package or module here shares
its name with a public function, so importing one never rebinds a name of
this namespace: `hpdl.parallel.zero` is always the function. docs/architecture.md
has the map.
"""

from __future__ import annotations

import importlib
from typing import Any

from hpdl.parallel.data import DataParallel, broadcast_tensors

_LAZY = {
    "zero": "hpdl.parallel.zero_redundancy",
    "ZeroOptimizer": "hpdl.parallel.zero_redundancy",
    "Pipeline": "hpdl.parallel.pipe",
    "Mesh": "hpdl.parallel.mesh",
    "Plan": "hpdl.parallel.mesh",
    "build": "hpdl.parallel.mesh",
    "clip_grad_norm_": "hpdl.parallel.mesh",
    "BranchParallel": "hpdl.parallel.branch",
    "Branches": "hpdl.parallel.branch",
}
"""Public name -> the package that offers it (imported on first access: start-up time, not a cycle)."""

__all__ = ["DataParallel", "broadcast_tensors", *_LAZY]


def __getattr__(name: str) -> Any:
    package = _LAZY.get(name)
    if package is None:
        raise AttributeError(f"module 'hpdl.parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(package), name)
    globals()[name] = value
    return value
