"""Parallel strategies that wrap a plain `torch.nn.Module`: data, ZeRO, pipeline and tensor parallelism, and the mesh.

Each strategy lives in its own module and is imported on first use, so that
`import hpdl.parallel` stays cheap and one strategy's dependencies never slow
another's start.
"""

from __future__ import annotations

import importlib
from typing import Any

from hpdl.parallel.data_parallel import DataParallel, broadcast_tensors

_LAZY = {
    "zero": "hpdl.parallel.zero",
    "ZeroOptimizer": "hpdl.parallel.zero",
    "Pipeline": "hpdl.parallel.pipeline",
    "Mesh": "hpdl.parallel.mesh",
    "Plan": "hpdl.parallel.plan_config",
    "build": "hpdl.parallel.mesh",
    "clip_grad_norm_": "hpdl.parallel.mesh",
}
"""Public name -> the module that defines it."""

__all__ = ["DataParallel", "broadcast_tensors", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hpdl.parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    # Cache it: importing hpdl.parallel.zero binds the *module* as this package's attribute `zero`.
    globals()[name] = value
    return value
