"""ZeRO stages 1, 2 and 3: shard optimizer state, gradients and parameters across data-parallel ranks.

    model, optimizer = hpdl.parallel.zero(model, comm, stage=2, optimizer=torch.optim.AdamW, lr=1e-3)
    loss_fn(model(x), y).backward()      # stage 2/3: gradients reduce-scattered during backward
    optimizer.clip_grad_norm_(1.0)       # global norm over every rank's shard
    optimizer.step(); optimizer.zero_grad()

Stage 1 keeps the optimizer state of this rank's part of the parameters only
(gradients are averaged by `DataParallel`'s bucketed allreduce, each rank
steps its part, the parts are all-gathered). Stage 2 also keeps only the
gradient shard (reduce-scatter per unit during backward, `reduce`). Stage
3 also shards the parameters and gathers a unit of them just before its
forward and backward, prefetching the next (`stage3`). The layout (units
split evenly over the ranks, balanced by bytes) is `partition`; each unit's
buffers are `units`; what a rank writes to and reads from a sharded
checkpoint is `checkpointing` (all modules of `hpdl.parallel.zero_redundancy`).
Memory per rank, for Psi parameters on N ranks, is `memory_formula`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from hpdl.checkpoint import ShardReader, ShardWriter
from hpdl.comm.base import Communicator
from hpdl.parallel.data.buckets import GradientReducer
from hpdl.parallel.shared import InnerOptimizerState, LocalAccumulation, MeshGroups, clip_by_global_norm_
from hpdl.parallel.tensor import tp_shards
from hpdl.parallel.zero_redundancy import checkpointing
from hpdl.parallel.zero_redundancy.partition import Unit, plan_units
from hpdl.parallel.zero_redundancy.reduce import ShardReducer
from hpdl.parallel.zero_redundancy.stage3 import ParamScheduler, WrapPolicy, tensors_of, units_by_policy
from hpdl.parallel.zero_redundancy.units import UnitBuffers, build_unit

__all__ = ["zero", "ZeroModel", "ZeroOptimizer", "memory_formula", "clip_zero_grad_norm_"]

STAGES = (1, 2, 3)
PRECISIONS: dict[Optional[str], Optional[torch.dtype]] = {None: None, "bf16": torch.bfloat16}


def zero(
    model: nn.Module,
    comm: Communicator,
    stage: int = 1,
    optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
    *,
    bucket_mb: float = 25.0,
    mixed_precision: Optional[str] = None,
    wrap_policy: WrapPolicy = None,
    prefetch: bool = True,
    offload_optimizer: bool = False,
    reshard_after_forward: bool = True,
    **optimizer_kwargs: Any,
) -> tuple[ZeroModel, ZeroOptimizer]:
    """Wrap `model` for ZeRO `stage` over `comm` and build `optimizer(**optimizer_kwargs)` on this rank's shard.

    Arguments:
        model: a plain `nn.Module` on its device; every rank passes the same
            architecture (rank 0's values are broadcast).
        comm: any Communicator (mpi, torch, self, or a sub-communicator).
        stage: 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters).
        optimizer: a `torch.optim.Optimizer` class (or factory taking a
            parameter list); element-wise optimizers (SGD, Adam, AdamW,
            RMSprop, Adagrad, ...) match one process exactly.
        bucket_mb: megabytes per unit at stages 1 and 2 (one allgather and,
            at stage 2, one reduce-scatter per unit); at stage 3 the default
            size-based wrap policy makes a unit of every submodule holding
            at least this many megabytes of parameters.
        mixed_precision: None or "bf16": parameters, activations and
            gradients in bfloat16, fp32 master copies and optimizer state.
        wrap_policy: stage 3 units: None (by size), an int (parameters per
            unit), a tuple of module classes, or a callable(module) -> bool.
        prefetch: stage 3: start gathering the next unit while one computes.
        offload_optimizer: keep master copies and optimizer state in host
            memory (parameters on a CUDA device only).
        reshard_after_forward: stage 3 (FSDP2's option): True frees each
            unit after its forward and gathers it again for its backward;
            False keeps units gathered from their forward until the next
            backward that reduces gradients, so a pipeline stage (or a
            `no_sync` loop) gathers them once per step, not twice per
            micro-batch, holding the stage's full parameters meanwhile.
    """
    wrapped = ZeroModel(
        model,
        comm,
        stage=stage,
        bucket_mb=bucket_mb,
        mixed_precision=mixed_precision,
        wrap_policy=wrap_policy,
        prefetch=prefetch,
        offload_optimizer=offload_optimizer,
        reshard_after_forward=reshard_after_forward,
    )
    return wrapped, ZeroOptimizer(wrapped, optimizer, **optimizer_kwargs)


def memory_formula(
    stage: int,
    numel: float,
    ranks: int,
    *,
    param_bytes: int = 4,
    state_bytes: int = 8,
    mixed_precision: bool = False,
    gathered_bytes: int = 0,
) -> dict[str, float]:
    """Bytes per rank of parameters, gradients and optimizer state for `numel` parameters (Psi) on `ranks` (N).

    `param_bytes`: bytes per element of the compute parameters (4 fp32,
    2 bf16); `state_bytes`: optimizer state per element (8 for Adam's two
    moments in fp32). Mixed precision adds 4-byte fp32 master copies (K =
    state + 4, DeepSpeed's K = 12 for Adam) and keeps the gradient shards of
    stages 2/3 in fp32. `gathered_bytes`: stage 3's gathered units.

        stage 1: params P*Psi + grads P*Psi     + K*Psi/N
        stage 2: params P*Psi + grads G*Psi/N   + K*Psi/N
        stage 3: params P*Psi/N (none with mixed precision: the master is the shard) + grads G*Psi/N
                 + K*Psi/N + gathered units
    """
    if stage not in (0, *STAGES):
        raise ValueError(f"stage={stage!r}: choose 0 (plain data parallel), 1, 2 or 3")
    psi, n = float(numel), float(ranks)
    master = 4 if mixed_precision else 0
    k = state_bytes + master
    grad_shard = 4 if mixed_precision else param_bytes
    if stage == 0:
        parts = {"params": param_bytes * psi, "grads": param_bytes * psi, "optimizer": k * psi}
    elif stage == 1:
        parts = {"params": param_bytes * psi, "grads": param_bytes * psi, "optimizer": k * psi / n}
    elif stage == 2:
        parts = {"params": param_bytes * psi, "grads": grad_shard * psi / n, "optimizer": k * psi / n}
    else:
        shard = 0 if mixed_precision else param_bytes * psi / n
        parts = {"params": shard + gathered_bytes, "grads": grad_shard * psi / n, "optimizer": k * psi / n}
    parts["total"] = sum(parts.values())
    return parts


class ZeroModel(LocalAccumulation, nn.Module):
    """The model side of ZeRO (build it with `zero(...)`): hooks that reduce gradients and gather parameters.

    `no_sync()` works as in `DataParallel`: backward passes inside only
    accumulate local full-size gradients; the next backward outside reduces
    the sum (allreduce at stage 1, reduce-scatter at stages 2 and 3).
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        *,
        stage: int = 1,
        bucket_mb: float = 25.0,
        mixed_precision: Optional[str] = None,
        wrap_policy: WrapPolicy = None,
        prefetch: bool = True,
        offload_optimizer: bool = False,
        reshard_after_forward: bool = True,
    ):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"zero wraps an nn.Module, got {type(module).__name__}")
        if isinstance(module, ZeroModel):
            raise TypeError("this model is already wrapped by zero(); wrap the plain module once")
        if stage not in STAGES:
            raise ValueError(f"stage={stage!r}: ZeRO has stages 1, 2 and 3 (use DataParallel for none)")
        if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            raise ValueError(f"bucket_mb={bucket_mb!r} must be a positive number of megabytes")
        if mixed_precision not in PRECISIONS:
            raise ValueError(f"mixed_precision={mixed_precision!r}: choose None or 'bf16'")
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward={reshard_after_forward!r} must be True or False")
        trainable = _unique_trainable(module, stage)
        if not trainable:
            raise ValueError("zero: the model has no parameter with requires_grad=True; nothing to train")
        for name, p in trainable:
            if not p.dtype.is_floating_point:
                raise TypeError(f"zero: parameter {name} has dtype {p.dtype}; ZeRO shards floating-point parameters")
        if offload_optimizer and any(p.device.type != "cuda" for _, p in trainable):
            raise ValueError(
                "offload_optimizer=True moves optimizer state from a GPU to host memory: the parameters must be on a "
                "CUDA device (move the model with .cuda() first), or leave offload_optimizer=False on CPU"
            )
        self.module = module
        self.comm = comm
        self.stage = stage
        self.mixed_precision = mixed_precision
        self.offload_optimizer = bool(offload_optimizer)
        self.compute_dtype = PRECISIONS[mixed_precision]
        self.master_dtypes = {name: p.dtype for name, p in trainable}
        _broadcast_each(comm, [*module.parameters(), *module.buffers()])

        bucket_bytes = int(bucket_mb * 1024 * 1024)
        named = dict(trainable)
        modules: list[Optional[nn.Module]]
        if stage == 3:
            element = max(p.element_size() for _, p in trainable)
            groups = units_by_policy(module, wrap_policy, max(1, bucket_bytes // element))
            modules = [m for m, _ in groups]
            self.units: list[Unit] = plan_units([g for _, g in groups], comm.size)
        else:  # reverse registration order: backward produces the last layers' gradients first
            self.units = plan_units([trainable[::-1]], comm.size, bucket_bytes)
            modules = [None] * len(self.units)
        self.shards: list[UnitBuffers] = [
            build_unit(
                unit,
                [named[s.name] for s in unit.slots],
                comm.rank,
                compute_dtype=self.compute_dtype,
                offload=self.offload_optimizer,
                sharded_params=stage == 3,
            )
            for unit in self.units
        ]
        if self.compute_dtype is not None:
            with torch.no_grad():
                for name, p in module.named_parameters():  # frozen parameters and buffers compute in bf16 too
                    if name not in named and p.dtype.is_floating_point:
                        p.data = p.data.to(self.compute_dtype)
                for b in module.buffers():
                    if b.dtype.is_floating_point:
                        b.data = b.data.to(self.compute_dtype)
        self.mesh: Optional[MeshGroups] = None
        """The `hpdl.parallel.Mesh` this model lives on (set by `hpdl.parallel.build`): clipping spans tp and pp."""
        self.pipeline_stages = 1
        """Stages of the pipeline this model is one stage of (set by `Pipeline`)."""
        self.scheduler: Optional[ParamScheduler] = None
        self.reducer: Any
        if stage == 1:
            params = [p for buffers in self.shards for p in buffers.params]
            self.reducer = GradientReducer(params, comm, bucket_mb=bucket_mb)
        else:
            for buffers in self.shards:
                buffers.allocate_grad(buffers.master.dtype)
            order = list(range(len(self.shards)))
            if stage == 3:
                order = order[::-1]  # registration order forward: backward meets the last units first
                self.scheduler = ParamScheduler(
                    self.shards,
                    modules,
                    comm,
                    prefetch=prefetch,
                    begin_backward=self._begin_backward,
                    reshard=reshard_after_forward,
                    poll=self._poll_reductions,
                )
            self.reducer = ShardReducer(
                self.shards,
                comm,
                order,
                on_unit_done=self.scheduler.unit_done if self.scheduler is not None else None,
                on_backward_end=self.scheduler.backward_done if self.scheduler is not None else None,
            )

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.compute_dtype is not None:
            args, kwargs = _cast((args, kwargs), self.compute_dtype)
        if self.scheduler is not None:
            self.scheduler.gather_root()
        out = self.module(*args, **kwargs)
        if self.scheduler is not None:
            self.scheduler.end_of_forward()
            if not torch.is_grad_enabled():
                self.scheduler.free_all()
            else:  # the root unit again before this output's backward (it may come after another's end)
                for t in tensors_of(out):
                    if t.requires_grad:
                        t.register_hook(self.scheduler.root_pre_backward)
        if self.compute_dtype is not None:
            out = _cast(out, torch.float32)
        return out

    def prefetch_for(self, kind: str) -> None:
        """Stage 3: start gathering what the next "forward" or "backward" pass needs first (a pipeline calls
        it between its actions, on every rank of the dp group in the same order: the gathers are collective)."""
        if kind not in ("forward", "backward"):
            raise ValueError(f"prefetch_for({kind!r}): say 'forward' or 'backward'")
        if self.scheduler is not None:
            self.scheduler.prefetch_for(kind)

    def _poll_reductions(self) -> None:
        self.reducer.poll()

    def _begin_backward(self) -> None:
        self.reducer.begin()

    @property
    def unsynced(self) -> bool:
        """True when local gradients from `no_sync` passes wait for a reduction."""
        return bool(self.reducer.unsynced)

    @property
    def peak_gathered_bytes(self) -> int:
        """Stage 3: the most bytes of gathered (or being gathered) units held at once so far; 0 at stages 1, 2."""
        return self.scheduler.peak_gathered if self.scheduler is not None else 0

    # ------------------------------------------------------------------ state
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every trainable parameter in full, in its master dtype (collective: allgathers at stage 3)."""
        out: dict[str, torch.Tensor] = {}
        for buffers in self.shards:
            unit = buffers.unit
            master = buffers.master
            if master.device != buffers.flat.device:
                master = master.to(buffers.flat.device)
            full = self.comm.allgather(master.contiguous())
            for slot in unit.slots:
                out[slot.name] = full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
        return out

    def load_master(self, name_ranges: Callable[[str, int, int], torch.Tensor]) -> None:
        """Fill every piece of this rank's master shard from `name_ranges(name, start, stop)`, then publish
        (collective at stages 1 and 2, where every rank's full parameters are rebuilt)."""
        with torch.no_grad():
            for buffers in self.shards:
                for piece in buffers.pieces:
                    values = name_ranges(piece.name, piece.start, piece.stop)
                    buffers.master[piece.shard_offset : piece.shard_offset + piece.numel].copy_(values)
        self.publish()

    def publish(self) -> None:
        """Stages 1 and 2: all-gather every rank's updated master shard into the full parameters."""
        if self.stage == 3:
            return
        works = [buffers.publish(self.comm) for buffers in self.shards]
        for buffers, work in zip(self.shards, works):
            work.wait()
            buffers.keep = []

    # hpdl.checkpoint.ShardedState: the format asks, the strategy knows its pieces
    def shard_layout(self) -> dict[str, Any]:
        return {"strategy": "zero", "stage": self.stage}

    def shard_shapes(self) -> dict[str, tuple[int, ...]]:
        return checkpointing.shapes(self)

    def write_shards(self, writer: ShardWriter) -> None:
        checkpointing.write_model(writer, self)

    def read_shards(self, reader: ShardReader) -> None:
        checkpointing.read_model(reader, self)

    def __repr__(self) -> str:
        return (
            f"ZeroModel(stage={self.stage}, ranks={self.comm.size}, units={len(self.units)}, "
            f"mixed_precision={self.mixed_precision}, module={self.module!r})"
        )


class ZeroOptimizer(InnerOptimizerState, torch.optim.Optimizer):
    """Steps this rank's shard of the parameters with any `torch.optim` optimizer (build it with `zero(...)`).

    It shares `param_groups` (LR schedulers work) and `state` with the inner
    optimizer, whose parameters are this rank's pieces of the model's
    parameters. `state_dict()` is this rank's shard; use `hpdl.checkpoint`
    to save and load across rank counts and strategies.
    """

    def __init__(self, model: ZeroModel, optimizer: Callable[..., torch.optim.Optimizer], **kwargs: Any):
        if not isinstance(model, ZeroModel):
            raise TypeError(f"ZeroOptimizer needs the model returned by zero(), got {type(model).__name__}")
        if isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "zero(optimizer=...) takes the optimizer class (torch.optim.AdamW) and its arguments (lr=...), "
                "not an optimizer instance: ZeRO builds it on this rank's shard"
            )
        if optimizer is torch.optim.LBFGS:
            raise ValueError(
                "LBFGS needs the whole parameter vector and closures; ZeRO supports element-wise optimizers"
            )
        self.model = model
        self.comm = model.comm
        pieces = [p for buffers in model.shards for p in buffers.piece_params]
        self._placeholder = not pieces
        if not pieces:  # more ranks than elements: this rank owns nothing, the optimizer still needs a parameter
            pieces = [nn.Parameter(torch.zeros(0, device=model.shards[0].master.device))]
        inner = optimizer(pieces, **kwargs)
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"optimizer={optimizer!r} did not build a torch.optim.Optimizer")
        super().__init__([{"params": [nn.Parameter(torch.empty(0))]}], dict(inner.defaults))
        self.__dict__.pop("_scratch", None)
        self.optimizer = inner

    # ------------------------------------------------------------------ gradients of this rank's pieces
    def _sync(self) -> None:
        if self.model.unsynced:
            self.model.sync_gradients()

    def _piece_grads(self) -> list[tuple[nn.Parameter, Optional[torch.Tensor]]]:
        """(piece parameter, its reduced gradient, a view where possible) for every piece of this rank."""
        return [(param, grad) for _, param, grad in _piece_grads(self.model)]

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, *, mesh: Optional[MeshGroups] = None
    ) -> torch.Tensor:
        """Scale every rank's gradient shard so that the global gradient norm is at most `max_norm`.

        Collective over the ZeRO ranks and, on a mesh, over its tp and pp
        groups. Returns the global norm before clipping (as
        `torch.nn.utils.clip_grad_norm_` does, with the same 1e-6 guard).
        `mesh`: the `hpdl.parallel.Mesh` the model lives on when it is
        tensor parallel or a pipeline stage (`hpdl.parallel.build` records
        it, so its optimizers need none): split parameters are summed over
        tp, replicated ones counted once, stages summed over pp.
        """
        return clip_zero_grad_norm_(self.model, max_norm, norm_type=norm_type, mesh=mesh)

    # ------------------------------------------------------------------ step
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        """Step this rank's pieces with their reduced gradients, then rebuild the full parameters (stages 1, 2)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync()
        for param, grad in self._piece_grads():
            if grad is None:
                param.grad = None
            elif grad.dtype != param.dtype or grad.device != param.device:
                param.grad = grad.to(device=param.device, dtype=param.dtype)
            else:
                param.grad = grad
        self.optimizer.step()
        for buffers in self.model.shards:
            for param in buffers.piece_params:
                param.grad = None
        self.model.publish()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients: the shards (stages 2, 3; with `set_to_none` their memory is released until the
        next backward reduces into them) and the full `.grad` of the model's parameters."""
        for p in self.model.module.parameters():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()
        for buffers in self.model.shards:
            if set_to_none:
                buffers.release_grad()
            elif buffers.has_grad:
                assert buffers.grad_flat is not None
                buffers.grad_flat.zero_()
                buffers.grad_fresh = True

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now for parameters, gradients and optimizer state, counted from tensor storages
        (each storage once; stage 3's released units count 0). Compare with `memory_formula`."""
        seen: set[int] = set()

        def size(tensors: Sequence[Optional[torch.Tensor]]) -> int:
            total = 0
            for t in tensors:
                if t is None:
                    continue
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total

        model = self.model
        params = size([b.flat for b in model.shards] + [b.master for b in model.shards])
        params += size(list(model.module.parameters()))
        grads = size([b.grad_flat for b in model.shards] + [p.grad for p in model.module.parameters()])
        if model.stage == 1:
            grads += size([bucket.flat for bucket in model.reducer.buckets])
        state = size([v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)])
        return {"params": params, "grads": grads, "optimizer": state, "total": params + grads + state}

    # ------------------------------------------------------------------ sharded state
    def piece_states(self) -> Iterator[tuple[str, int, int, dict[str, Any]]]:
        """(parameter name, start, stop, optimizer state of that piece) for every piece of this rank."""
        for buffers in self.model.shards:
            for piece, param in zip(buffers.pieces, buffers.piece_params):
                yield piece.name, piece.start, piece.stop, self.optimizer.state.get(param, {})

    def set_piece_state(self, name: str, start: int, state: dict[str, Any]) -> None:
        """Install `state` as the optimizer state of this rank's piece of `name` beginning at `start`."""
        for buffers in self.model.shards:
            for piece, param in zip(buffers.pieces, buffers.piece_params):
                if piece.name == name and piece.start == start:
                    self.optimizer.state[param] = state
                    return
        raise KeyError(f"this rank holds no piece of {name} starting at {start}")

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: hyperparameters and the state of each piece, keyed by parameter name and range."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        pieces = {f"{name}[{start}:{stop}]": dict(state) for name, start, stop, state in self.piece_states()}
        return {
            "zero": {"stage": self.model.stage, "ranks": self.comm.size, "rank": self.comm.rank},
            "param_groups": groups,
            "pieces": pieces,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what `state_dict()` returned on this rank with the same number of ranks and stage layout.

        To load across rank counts or strategies use `hpdl.checkpoint.load`, which reshards.
        """
        meta = state_dict.get("zero") if isinstance(state_dict, dict) else None
        if not isinstance(meta, dict):
            raise ValueError("ZeroOptimizer.load_state_dict takes what ZeroOptimizer.state_dict() returned")
        if meta.get("ranks") != self.comm.size or meta.get("rank") != self.comm.rank:
            raise ValueError(
                f"this optimizer shard is rank {meta.get('rank')} of {meta.get('ranks')}; "
                f"here rank {self.comm.rank} of "
                f"{self.comm.size}: load across rank counts with hpdl.checkpoint.load (it reshards)"
            )
        mine = {f"{name}[{start}:{stop}]": (name, start) for name, start, stop, _ in self.piece_states()}
        if set(mine) != set(state_dict["pieces"]):
            raise ValueError("this optimizer shard was saved with another unit layout (stage or bucket_mb differ)")
        for key, state in state_dict["pieces"].items():
            name, start = mine[key]
            self.set_piece_state(name, start, dict(state))
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            group.update(saved)

    # hpdl.checkpoint.ShardedOptimizer: the format asks, the strategy knows its pieces
    def write_shards(self, writer: ShardWriter) -> None:
        checkpointing.write_optimizer(writer, self)

    def read_shards(self, reader: ShardReader, values: dict[str, Any]) -> None:
        checkpointing.read_optimizer(reader, self, values)

    def __repr__(self) -> str:
        return f"ZeroOptimizer(stage={self.model.stage}, ranks={self.comm.size}, inner={self.optimizer!r})"


@torch.no_grad()
def clip_zero_grad_norm_(
    model: ZeroModel, max_norm: float, *, norm_type: float = 2.0, mesh: Optional[MeshGroups] = None
) -> torch.Tensor:
    """`ZeroOptimizer.clip_grad_norm_` (and `hpdl.parallel.mesh.clip_grad_norm_` of a ZeRO model): the shards
    are disjoint over the ZeRO ranks, so their partial norms are summed there, then over tp and pp on a mesh."""
    mesh = mesh if mesh is not None else model.mesh
    split = set(tp_shards(model.module))
    if mesh is None and (split or model.pipeline_stages > 1):
        where = (
            f"{len(split)} of its parameters are tensor-parallel slices"
            if split
            else f"it is one stage of a {model.pipeline_stages}-stage pipeline"
        )
        raise ValueError(
            f"clip_grad_norm_: this ZeRO model is part of a larger model ({where}); a norm over the ZeRO ranks "
            "alone would differ between tp ranks or stages and the replicas would drift apart. Pass "
            "mesh=<the hpdl.parallel.Mesh it lives on> (models from hpdl.parallel.build carry theirs), or call "
            "hpdl.parallel.clip_grad_norm_(model, max_norm, mesh)"
        )
    if mesh is not None:
        if not isinstance(mesh, MeshGroups):
            raise TypeError(f"clip_grad_norm_: mesh must be an hpdl.parallel.Mesh, got {type(mesh).__name__}")
        if (mesh.dp.size, mesh.dp.rank) != (model.comm.size, model.comm.rank):
            raise ValueError(
                f"clip_grad_norm_: the mesh's dp group (rank {mesh.dp.rank} of {mesh.dp.size}) is not the ZeRO "
                f"group (rank {model.comm.rank} of {model.comm.size}): pass the mesh the model was built on"
            )
    if model.unsynced:
        model.sync_gradients()
    pieces = [(name, grad) for name, _, grad in _piece_grads(model) if grad is not None]
    first_tp = mesh is None or mesh.tp.rank == 0
    return clip_by_global_norm_(
        [g for _, g in pieces],
        max_norm,
        counted=[g for name, g in pieces if first_tp or name in split],
        groups=(model.comm,) if mesh is None else (model.comm, mesh.tp, mesh.pp),
        norm_type=norm_type,
    )


def _piece_grads(model: ZeroModel) -> list[tuple[str, nn.Parameter, Optional[torch.Tensor]]]:
    """(parameter name, piece parameter, its reduced gradient, a view where possible) for every piece here."""
    out: list[tuple[str, nn.Parameter, Optional[torch.Tensor]]] = []
    for buffers in model.shards:
        used = buffers.used.tolist() if buffers.has_grad and buffers.used is not None else []
        for piece, param in zip(buffers.pieces, buffers.piece_params):
            grad: Optional[torch.Tensor]
            if buffers.grad is not None:  # stages 2 and 3: the reduced shard, if some rank had a gradient
                used_here = bool(used) and used[piece.index] > 0
                grad = buffers.grad[piece.shard_offset : piece.shard_offset + piece.numel] if used_here else None
            else:  # stage 1: this rank's part of the averaged full gradient
                full = buffers.params[piece.index].grad
                grad = None if full is None else full.reshape(-1)[piece.start : piece.stop]
            out.append((piece.name, param, grad))
    return out


def _unique_trainable(module: nn.Module, stage: int) -> list[tuple[str, nn.Parameter]]:
    seen: dict[int, str] = {}
    out = []
    for name, p in module.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
        if id(p) in seen:
            if stage == 3:
                raise ValueError(
                    f"zero stage 3: parameters {seen[id(p)]} and {name} are the same tensor (tied weights); "
                    "stage 3 shards each parameter once: untie them or use stage 1 or 2"
                )
            continue
        seen[id(p)] = name
        out.append((name, p))
    return out


def _broadcast_each(comm: Communicator, tensors: list[torch.Tensor]) -> None:
    """Rank 0's values into every rank's tensors, one broadcast per tensor: no flat copy of the whole model
    (at stage 3 the model may not fit twice), nothing left in a communicator's shared buffers."""
    if comm.size == 1:
        return
    with torch.no_grad():
        for t in tensors:
            data = t.detach()
            if data.is_contiguous():
                comm.broadcast(data, 0)
            else:
                copy = data.contiguous()
                comm.broadcast(copy, 0)
                data.copy_(copy)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple):
        return tuple(_cast(v, dtype) for v in value)
    if isinstance(value, list):
        return [_cast(v, dtype) for v in value]
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value
