"""`clip_grad_norm_` of a model built on a `Mesh`: one global norm over every axis, each parameter counted once."""

from __future__ import annotations

from typing import Any

import torch

from hpdl.parallel.branch.module import branch_parameters
from hpdl.parallel.mesh.mesh import Mesh
from hpdl.parallel.mesh.state import view_of
from hpdl.parallel.shared import clip_by_global_norm_
from hpdl.parallel.tensor import tp_shards
from hpdl.parallel.zero_redundancy import ZeroModel, clip_zero_grad_norm_

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(model: Any, max_norm: float, mesh: Mesh, *, norm_type: float = 2.0) -> torch.Tensor:
    """Scale this rank's gradients so that the global gradient norm of the whole model is at most `max_norm`.

    Call it after backward (or `pipe.step`) and before `optimizer.step()`
    on every rank of the mesh (collective over tp and pp, and dp under
    ZeRO). The norm counts each logical parameter once: tp slices of split
    parameters and the branches of `BranchParallel` blocks (each on one tp
    rank) are summed over the tp group, replicated parameters (layer
    norms, row biases) are counted on tp rank 0 only, stages are summed
    over pp, and dp replicas already hold the same averaged gradients (ZeRO
    shards, which are disjoint, are summed over dp). Returns the norm
    before clipping (like `torch.nn.utils.clip_grad_norm_`, with its 1e-6
    guard).
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"clip_grad_norm_: mesh must be the hpdl.parallel.Mesh the model was built on, got {mesh!r}")
    view = view_of(model)
    if isinstance(view.wrapper, ZeroModel):  # disjoint shards over dp: summed there too
        return clip_zero_grad_norm_(view.wrapper, max_norm, norm_type=norm_type, mesh=mesh)
    split = set(tp_shards(view.plain)) | set(branch_parameters(view.plain))  # held by one tp rank each
    named = [(name in split, p.grad) for name, p in view.plain.named_parameters() if p.grad is not None]
    return clip_by_global_norm_(
        [g for _, g in named],
        max_norm,
        counted=[g for is_split, g in named if is_split or mesh.tp.rank == 0],
        groups=(mesh.tp, mesh.pp),
        norm_type=norm_type,
    )
