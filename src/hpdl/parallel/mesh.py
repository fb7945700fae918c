"""`Mesh`: one world split into dp x pp x tp sub-communicators, and `build`, the one entry for every strategy.

    mesh = hpdl.parallel.Mesh(comm, dp=2, pp=2, tp=1)          # -1 infers one degree
    mesh.dp, mesh.pp, mesh.tp                                   # sub-communicators (Communicator)
    model, optimizer = hpdl.parallel.build(model, mesh, plan)   # tp, then pipeline, then dp / ZeRO

Rank placement: the axes are laid out from innermost (consecutive world
ranks) to outermost, by default tp, dp, pp: a tensor-parallel group is a
run of consecutive ranks, which launchers put on one node (tp exchanges
activations in every layer, so it needs the fastest links); pipeline stages
are outermost, across nodes (they exchange one activation per micro-batch).
`placement=("dp", "tp", "pp")` and the like override it. Every rank
calls the constructor (it splits the communicator three times).
"""

from __future__ import annotations

import logging
import math
import weakref
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from hpdl.comm.base import Communicator
from hpdl.parallel.data_parallel import DataParallel
from hpdl.parallel.plan_config import AXES, Plan, PlanError, resolve_degrees
from hpdl.parallel.tensor.parallelize import parallelize

__all__ = ["Mesh", "build", "clip_grad_norm_", "clip_by_global_norm_"]

log = logging.getLogger(__name__)


class Mesh:
    """The world as a dp x pp x tp grid; `dp`, `pp`, `tp` are this rank's sub-communicators along each axis.

    `mesh.dp` holds the ranks with this rank's pipeline stage and tp index
    (they hold the same parameters and split the batch); `mesh.pp` the
    ranks with this rank's dp and tp index (one per stage); `mesh.tp` the
    ranks with this rank's dp index and stage (they split each layer).
    """

    def __init__(
        self,
        comm: Communicator,
        *,
        dp: int = -1,
        pp: int = 1,
        tp: int = 1,
        placement: Sequence[str] = AXES,
    ):
        if not isinstance(comm, Communicator):
            raise TypeError(f"Mesh: comm must be an hpdl Communicator (hpdl.init()), got {type(comm).__name__}")
        placement = tuple(placement)
        if sorted(placement) != sorted(AXES):
            raise ValueError(f"Mesh: placement={list(placement)} must order the axes {list(AXES)}, innermost first")
        self.world = comm
        self.placement = placement
        try:
            self.shape: dict[str, int] = resolve_degrees(comm.size, dp, pp, tp)
        except PlanError as exc:
            raise ValueError(f"Mesh: {exc}") from None
        self.coords = self._coordinates(comm.rank)
        subs: dict[str, Communicator] = {}
        for axis in ("dp", "pp", "tp"):  # the same order on every rank: split is collective
            others = [a for a in AXES if a != axis]
            color = self.coords[others[0]] * self.shape[others[1]] + self.coords[others[1]]
            sub = comm.split(color, key=self.coords[axis])
            if sub is None or sub.size != self.shape[axis] or sub.rank != self.coords[axis]:
                raise RuntimeError(f"Mesh: the {axis} split of rank {comm.rank} gave {sub!r}")
            subs[axis] = sub
        self.dp, self.pp, self.tp = subs["dp"], subs["pp"], subs["tp"]
        self._warn_if_tp_crosses_nodes()

    # ------------------------------------------------------------------ coordinates
    def _coordinates(self, rank: int) -> dict[str, int]:
        coords, rest = {}, rank
        for axis in self.placement:  # innermost first: rank = c0 + n0 * (c1 + n1 * c2)
            coords[axis] = rest % self.shape[axis]
            rest //= self.shape[axis]
        return coords

    def coordinates(self, rank: Optional[int] = None) -> dict[str, int]:
        """{"dp": i, "pp": j, "tp": k} of `rank` (default: this rank)."""
        return dict(self.coords) if rank is None else self._coordinates(rank)

    def rank_of(self, *, dp: int, pp: int, tp: int) -> int:
        """The world rank at these coordinates."""
        coords = {"dp": dp, "pp": pp, "tp": tp}
        for axis, value in coords.items():
            if not 0 <= value < self.shape[axis]:
                raise ValueError(f"Mesh.rank_of: {axis}={value} is outside 0..{self.shape[axis] - 1}")
        rank, stride = 0, 1
        for axis in self.placement:
            rank += coords[axis] * stride
            stride *= self.shape[axis]
        return rank

    @property
    def size(self) -> int:
        return self.world.size

    def _warn_if_tp_crosses_nodes(self) -> None:
        local = self.world.local_size
        if self.shape["tp"] == 1 or local <= 1 or local >= self.world.size:
            return
        stride = math.prod(self.shape[a] for a in self.placement[: self.placement.index("tp")])
        span = stride * (self.shape["tp"] - 1) + 1
        if self.placement[0] != "tp" or span > local or local % self.shape["tp"]:
            log.warning(
                "Mesh: tensor-parallel groups of %d ranks (spanning %d consecutive ranks) do not fit in a node of "
                "%d ranks: every layer's allreduce crosses nodes. Put 'tp' first in placement and keep tp <= %d.",
                self.shape["tp"],
                span,
                local,
                local,
            )

    def describe(self) -> str:
        """The grid: degrees, placement and every world rank's coordinates."""
        head = (
            f"Mesh dp={self.shape['dp']} x pp={self.shape['pp']} x tp={self.shape['tp']} = {self.size} ranks "
            f"(innermost first: {', '.join(self.placement)})"
        )
        rows = [
            f"  rank {r}: " + " ".join(f"{a}={c}" for a, c in self._coordinates(r).items()) for r in range(self.size)
        ]
        return "\n".join([head, *rows])

    def __repr__(self) -> str:
        c = self.coords
        return (
            f"Mesh(dp={self.shape['dp']}, pp={self.shape['pp']}, tp={self.shape['tp']}; rank {self.world.rank} at "
            f"dp={c['dp']} pp={c['pp']} tp={c['tp']})"
        )

    @classmethod
    def from_plan(cls, comm: Communicator, plan: Plan) -> Mesh:
        """The mesh of `plan`'s degrees and placement over `comm`."""
        return cls(comm, dp=plan.dp, pp=plan.pp, tp=plan.tp, placement=plan.placement)

    def close(self) -> None:
        """Release the three sub-communicators (the world stays open)."""
        for sub in (self.tp, self.pp, self.dp):
            sub.close()


# ---------------------------------------------------------------------- build: the one entry point
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
    optimizer.step()`. With one it is a `Pipeline`: `loss = pipe.step(x, y,
    loss_fn); optimizer.step()`. When the plan splits the output layer's
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
        plan = Plan(dp=shape["dp"], pp=shape["pp"], tp=shape["tp"], micro_batches=shape["pp"], placement=mesh.placement)
    plan = plan.validate(mesh.size, model)
    if plan.degrees() != mesh.shape:
        have = " x ".join(f"{a}={mesh.shape[a]}" for a in ("dp", "pp", "tp"))
        want = " x ".join(f"{a}={getattr(plan, a)}" for a in ("dp", "pp", "tp"))
        raise PlanError(f"build: the plan asks for {want} but the mesh is {have}; build the mesh with Mesh.from_plan")
    if tuple(plan.placement) != tuple(mesh.placement):
        raise PlanError(
            f"build: the plan places the axes {list(plan.placement)} but the mesh {list(mesh.placement)}; "
            "build the mesh with Mesh.from_plan"
        )
    if mesh.tp.size > 1:
        parallelize(model, mesh.tp, plan.tp_plan_for(model))
    if plan.pp > 1:
        return _build_pipeline(model, mesh, plan, optimizer, optimizer_options)
    if plan.zero_stage:
        from hpdl.parallel.zero import zero

        zmodel, zopt = zero(
            model,
            mesh.dp,
            plan.zero_stage,
            optimizer,
            bucket_mb=plan.bucket_mb,
            mixed_precision=plan.mixed_precision,
            **optimizer_options,
        )
        zmodel.mesh = mesh  # the ZeRO optimizer's clip_grad_norm_ then spans tp as well
        return zmodel, zopt
    wrapped: nn.Module = model
    if mesh.dp.size > 1:
        wrapped = DataParallel(model, mesh.dp, bucket_mb=plan.bucket_mb, compression=plan.compression)
    return wrapped, optimizer(wrapped.parameters(), **optimizer_options)


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
    from hpdl.parallel.pipeline import Pipeline

    if not isinstance(model, nn.Sequential):
        raise PlanError(f"build: pp={plan.pp} splits an nn.Sequential into stages; got {type(model).__name__}")
    made: dict[str, torch.optim.Optimizer] = {}

    def wrap(stage: nn.Module) -> nn.Module:
        if plan.zero_stage:
            from hpdl.parallel.zero import zero

            zmodel, zopt = zero(
                stage,
                mesh.dp,
                plan.zero_stage,
                optimizer,
                bucket_mb=plan.bucket_mb,
                mixed_precision=plan.mixed_precision,
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
    opt = made.get("optimizer") or optimizer(pipe.parameters(), **optimizer_options)
    return pipe, opt


LAYER_NAMES: weakref.WeakKeyDictionary[Any, list[str]] = weakref.WeakKeyDictionary()
"""Pipeline built by `build` -> the names of the model's layers, so that stage parameters keep their model names."""


@torch.no_grad()
def clip_by_global_norm_(
    grads: Iterable[Optional[torch.Tensor]],
    max_norm: float,
    *,
    counted: Optional[Iterable[Optional[torch.Tensor]]] = None,
    groups: Sequence[Optional[Communicator]] = (),
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Scale `grads` in place so that their global norm is at most `max_norm`; return the norm before clipping.

    The one implementation behind every `clip_grad_norm_` of hpdl (plain or
    data parallel, ZeRO shards, tp x pp meshes). `counted`: the gradients
    that enter the norm (default: all of `grads`; a tp rank > 0 leaves its
    replicated parameters out so they count once). `groups`: communicators
    over which this rank's partial sum of |g|^p (max |g| for the inf-norm)
    is combined: the ranks that hold *other* parts of the model. Collective
    over each group. Computes on the gradients' device in their dtype (at
    least float32) and scales as `torch.nn.utils.clip_grad_norm_` does,
    with its 1e-6 guard.
    """
    try:
        limit = float(max_norm)
    except (TypeError, ValueError):
        raise TypeError(f"clip_grad_norm_: max_norm={max_norm!r} must be a positive number") from None
    if not limit > 0:
        raise ValueError(f"clip_grad_norm_: max_norm={max_norm!r} must be a positive number")
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type={norm_type!r} must be positive (2.0, 1.0 or inf)")
    scaled = [g for g in grads if g is not None]
    terms = scaled if counted is None else [g for g in counted if g is not None]
    device = scaled[0].device if scaled else torch.device("cpu")
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in scaled) else torch.float32
    infinite = math.isinf(norm_type)
    parts = [g.detach() for g in terms if g.numel()]
    if not parts:
        local = torch.zeros((), dtype=dtype, device=device)
    elif infinite:
        local = torch.stack([g.abs().max().to(device, dtype) for g in parts]).max()
    else:
        powers = [torch.linalg.vector_norm(g, norm_type, dtype=dtype).to(device) ** norm_type for g in parts]
        local = torch.stack(powers).sum()
    reduce = [c for c in groups if c is not None and c.size > 1]
    if reduce:  # one number per rank: float64 on the host, whatever the device
        wire = local.reshape(1).to("cpu", torch.float64)
        for comm in reduce:
            comm.allreduce(wire, "max" if infinite else "sum")
        local = wire.reshape(()).to(device, dtype)
    total = local if infinite else local ** (1.0 / norm_type)
    coefficient = torch.clamp(limit / (total + 1e-6), max=1.0)
    for g in scaled:
        g.detach().mul_(coefficient.to(g.device, g.dtype))
    return total


def clip_grad_norm_(model: Any, max_norm: float, mesh: Mesh, *, norm_type: float = 2.0) -> torch.Tensor:
    """Scale this rank's gradients so that the global gradient norm of the whole model is at most `max_norm`.

    Call it after backward (or `pipe.step`) and before `optimizer.step()`
    on every rank of the mesh (collective over tp and pp, and dp under
    ZeRO). The norm counts each logical parameter once: tp slices of split
    parameters are summed over the tp group, replicated parameters (layer
    norms, row biases) are counted on tp rank 0 only, stages are summed
    over pp, and dp replicas already hold the same averaged gradients (ZeRO
    shards, which are disjoint, are summed over dp). Returns the norm
    before clipping (like `torch.nn.utils.clip_grad_norm_`, with its 1e-6
    guard).
    """
    from hpdl.parallel.mesh_state import _view
    from hpdl.parallel.tensor.state import tp_shards
    from hpdl.parallel.zero import ZeroModel, clip_zero_grad_norm_

    if not isinstance(mesh, Mesh):
        raise TypeError(f"clip_grad_norm_: mesh must be the hpdl.parallel.Mesh the model was built on, got {mesh!r}")
    view = _view(model)
    if isinstance(view.wrapper, ZeroModel):  # disjoint shards over dp: summed there too
        return clip_zero_grad_norm_(view.wrapper, max_norm, norm_type=norm_type, mesh=mesh)
    split = set(tp_shards(view.plain))
    named = [(name in split, p.grad) for name, p in view.plain.named_parameters() if p.grad is not None]
    return clip_by_global_norm_(
        [g for _, g in named],
        max_norm,
        counted=[g for is_split, g in named if is_split or mesh.tp.rank == 0],
        groups=(mesh.tp, mesh.pp),
        norm_type=norm_type,
    )
