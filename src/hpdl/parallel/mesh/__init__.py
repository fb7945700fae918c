"""The mesh, on top of every strategy: one world split into dp x pp x tp, a `Plan`, and `build`, which composes
tensor parallelism, the pipeline and data parallelism or ZeRO on it.

- `mesh`: `Mesh`, the grid of sub-communicators;
- `plan_config`: `Plan`, the typed, validated description of a layout;
- `compose`: `build`, the one entry that applies a plan to a plain model;
- `clip`: `clip_grad_norm_` over every axis of a mesh;
- `state`: the full (logical) state of a built model, and sharded save/load on any mesh.
"""

from hpdl.parallel.mesh.clip import clip_grad_norm_
from hpdl.parallel.mesh.compose import build
from hpdl.parallel.mesh.mesh import Mesh
from hpdl.parallel.mesh.plan_config import Plan, PlanError
from hpdl.parallel.mesh.state import full_state, load_state
from hpdl.parallel.shared import clip_by_global_norm_

__all__ = ["Mesh", "Plan", "PlanError", "build", "clip_grad_norm_", "clip_by_global_norm_", "full_state", "load_state"]
