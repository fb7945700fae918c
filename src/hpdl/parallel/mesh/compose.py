"""`build`: the one entry for every strategy: apply a `Plan` to a plain model on a `Mesh`.

    mesh = hpdl.parallel.Mesh(comm, dp=2, pp=2, tp=1)          # -1 infers one degree
    model, optimizer = hpdl.parallel.build(model, mesh, plan)   # tp, then pipeline, then dp / ZeRO

It sits above every strategy package and composes them in torchtitan's
order: tensor parallelism, the pipeline, then data parallelism or ZeRO. A
spatial plan (sp > 1) wraps the model, or with a pipeline its first
`spatial_stages` stages, in `SpatialParallel` over `mesh.sp`, their
gradients averaged over dp x sp.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Optional

import torch
from torch import nn

from hpdl.parallel.branch.block import BRANCH_STYLE, spread
from hpdl.parallel.data import DataParallel, broadcast_tensors
from hpdl.parallel.mesh.mesh import Mesh
from hpdl.parallel.mesh.plan_config import DEGREES, Plan, PlanError
from hpdl.parallel.mesh.state import LAYER_NAMES
from hpdl.parallel.pipe import Pipeline
from hpdl.parallel.spatial import SpatialParallel
from hpdl.parallel.spatial.convert import GLOBAL_POOLS
from hpdl.parallel.tensor import parallelize
from hpdl.parallel.zero_redundancy import zero

__all__ = ["build"]


def build(
    model: nn.Module,
    mesh: Mesh,
    plan: Optional[Plan] = None,
    *,
    optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
    **optimizer_options: Any,
) -> tuple[Any, torch.optim.Optimizer]:
    """Apply `plan` to the plain `model` on `mesh`; return (model or pipeline, optimizer).

    Order (torchtitan's): tensor parallelism first (`parallelize` over
    `mesh.tp`, by the plan's or the model's `tp_plan`), then the pipeline
    over `mesh.pp` (each rank keeps its stage), then data parallelism over
    `mesh.dp`: `DataParallel`, or ZeRO stage 1/2/3 when `plan.zero_stage`
    is set. `optimizer` is a `torch.optim` class built with
    `optimizer_options` (lr=...) over this rank's parameters (its stage,
    its tp slices, its ZeRO shard).

    Without a pipeline the result is a module: `loss_fn(model(x), y).backward();
    optimizer.step()`. With sp > 1 (and pp = 1) it is a `SpatialParallel` over `mesh.sp`
    whose gradients are averaged over `mesh.group("dp", "sp")`: each dp
    replica takes its slice of the batch and each rank of its spatial group
    passes its slab, `hpdl.parallel.spatial.shard(x, mesh.sp, plan.spatial_dim, plan.spatial_grid)` (or the
    returned model's own `shard(x)`).
    With a pipeline it is a `Pipeline`: `loss = pipe.step(x, y, loss_fn);
    optimizer.step()` (with sp > 1 its first `plan.spatial_stages` stages are spatial; their ranks pass
    `pipe.module.shard(x)`). When the plan splits the output layer's
    vocabulary (GPT's tp_plan), compute the loss with
    `hpdl.parallel.tensor.vocab_parallel_cross_entropy(logits, y, mesh.tp)`.
    Collective over the mesh's world.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"build: model must be a plain nn.Module, got {type(model).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"build: mesh must be an hpdl.parallel.Mesh, got {type(mesh).__name__}")
    if plan is None:
        shape = mesh.shape
        plan = Plan(
            dp=shape["dp"], pp=shape["pp"], tp=shape["tp"], sp=shape["sp"], micro_batches=shape["pp"],
            placement=mesh.placement,
        )  # fmt: skip
    plan = plan.validate(mesh.size, model)
    if plan.degrees() != mesh.shape:
        have = " x ".join(f"{a}={mesh.shape[a]}" for a in DEGREES)
        want = " x ".join(f"{a}={getattr(plan, a)}" for a in DEGREES)
        raise PlanError(f"build: the plan asks for {want} but the mesh is {have}; build the mesh with Mesh.from_plan")
    if tuple(plan.placement) != tuple(mesh.placement):
        raise PlanError(
            f"build: the plan places the axes {list(plan.placement)} but the mesh {list(mesh.placement)}; "
            "build the mesh with Mesh.from_plan"
        )
    if plan.sp > 1 and plan.pp == 1:
        return _build_spatial(model, mesh, plan, optimizer, optimizer_options)
    if mesh.tp.size > 1:
        _tensor_parallel(model, mesh, plan.tp_plan_for(model))
    if plan.pp > 1:
        return _build_pipeline(model, mesh, plan, optimizer, optimizer_options)
    if plan.zero_stage:
        zmodel, zopt = zero(
            model,
            mesh.dp,
            plan.zero_stage,
            optimizer,
            bucket_mb=plan.bucket_mb,
            mixed_precision=plan.mixed_precision,
            reshard_after_forward=plan.reshard_after_forward,
            **optimizer_options,
        )
        zmodel.mesh = mesh  # the ZeRO optimizer's clip_grad_norm_ then spans tp as well
        return zmodel, zopt
    wrapped: nn.Module = model
    if mesh.dp.size > 1:
        wrapped = DataParallel(model, mesh.dp, bucket_mb=plan.bucket_mb, compression=plan.compression)
    return wrapped, optimizer(wrapped.parameters(), **optimizer_options)


def _tensor_parallel(model: nn.Module, mesh: Mesh, tp_plan: dict[str, str]) -> None:
    """The tp_plan applied over mesh.tp: `Branches` blocks ("branch") spread as `BranchParallel`, the rest
    split by `parallelize`; tp rank 0's values first, so that ranks that initialised differently agree."""
    branches = {pattern for pattern, style in tp_plan.items() if style == BRANCH_STYLE}
    rest = {pattern: style for pattern, style in tp_plan.items() if pattern not in branches}
    if branches:
        broadcast_tensors(mesh.tp, [*model.parameters(), *model.buffers()], root=0)
        chosen = [n for n, _ in model.named_modules() if n and any(fnmatch.fnmatchcase(n, p) for p in branches)]
        for name in [n for n in chosen if not any(n.startswith(f"{outer}.") for outer in chosen)]:
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, spread(getattr(parent, attr), mesh.tp))
    if rest:
        parallelize(model, mesh.tp, rest)


def _build_spatial(
    model: nn.Module,
    mesh: Mesh,
    plan: Plan,
    optimizer: Callable[..., torch.optim.Optimizer],
    optimizer_options: dict[str, Any],
) -> tuple[Any, torch.optim.Optimizer]:
    """Sample + spatial parallelism: slabs over mesh.sp; gradients averaged over dp x sp equal one process's."""
    wrapped = _spatial(model, mesh, plan, mesh.group("dp", "sp"))
    return wrapped, optimizer(wrapped.parameters(), **optimizer_options)


def _spatial(model: nn.Module, mesh: Mesh, plan: Plan, grads: Any, gather_output: bool = False) -> SpatialParallel:
    """`model` split over mesh.sp as the plan says, its gradients averaged over `grads` (the dp x sp group)."""
    return SpatialParallel(
        model,
        mesh.sp,
        plan.spatial_dim,
        grid=plan.spatial_grid,
        grad_comm=grads,
        bucket_mb=plan.bucket_mb,
        gather_output=gather_output,
    )


def _build_pipeline(
    model: nn.Module,
    mesh: Mesh,
    plan: Plan,
    optimizer: Callable[..., torch.optim.Optimizer],
    optimizer_options: dict[str, Any],
) -> tuple[Any, torch.optim.Optimizer]:
    """Pipeline over mesh.pp of the (already tensor-parallel) model; each stage data-parallel or ZeRO over mesh.dp.

    The stage wrapper has `no_sync()`, so the pipeline accumulates the
    micro-batches' gradients locally and reduces once per step (ZeRO-2: one
    reduce-scatter per step, not per micro-batch).
    """
    if not isinstance(model, nn.Sequential):
        raise PlanError(f"build: pp={plan.pp} splits an nn.Sequential into stages; got {type(model).__name__}")
    made: dict[str, torch.optim.Optimizer] = {}
    stage_index = mesh.pp.rank
    spatial_grads = mesh.group("dp", "sp") if plan.sp > 1 else None  # collective: every rank, before any stage

    def wrap(stage: nn.Module) -> nn.Module:
        if plan.sp > 1 and stage_index < plan.spatial_stages:
            # spatial + layer parallelism: this stage's activations split over sp; the last spatial stage hands
            # whole tensors on (unless its global pool / Flatten already made them whole)
            ends_whole = any(isinstance(m, (*GLOBAL_POOLS, nn.Flatten)) for m in stage.modules())
            return _spatial(stage, mesh, plan, spatial_grads, stage_index == plan.spatial_stages - 1 and not ends_whole)
        if plan.zero_stage:
            zmodel, zopt = zero(
                stage,
                mesh.dp,
                plan.zero_stage,
                optimizer,
                bucket_mb=plan.bucket_mb,
                mixed_precision=plan.mixed_precision,
                reshard_after_forward=plan.reshard_after_forward,
                **optimizer_options,
            )
            zmodel.mesh = mesh  # the ZeRO optimizer's clip_grad_norm_ then spans tp and pp as well
            made["optimizer"] = zopt
            return zmodel
        if mesh.dp.size > 1:
            return DataParallel(stage, mesh.dp, bucket_mb=plan.bucket_mb, compression=plan.compression)
        return stage

    pipe = Pipeline(
        model,
        mesh.pp,
        chunks=plan.micro_batches,
        schedule=plan.pipeline_schedule or "1f1b",
        balance=plan.balance,
        checkpoint=plan.recompute,
        wrap_stage=wrap,
    )
    LAYER_NAMES[pipe] = [name for name, _ in model.named_children()]
    # A stage without parameters (a ReLU alone) gets an optimizer of one empty group: torch refuses an empty
    # list, and that rank alone raising left the other stages waiting on it.
    params = list(pipe.parameters())
    opt = made.get("optimizer") or optimizer(params or [{"params": []}], **optimizer_options)
    return pipe, opt
