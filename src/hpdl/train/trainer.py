"""`Trainer`: the epoch loop for every plan, with the things every run needs.

It runs a data-parallel or ZeRO model, or whatever `hpdl.parallel.build(model,
mesh, plan)` returned (pass `mesh=`, or start from `Trainer.from_plan`):
pipelines with micro-batches, dp x pp x tp with ZeRO, spatial and branch
plans; `hpdl.train.plans` holds what differs between them.

Per step: forward (under autocast when asked), the loss of every rank
gathered (one tiny allgather: the global mean for the progress bar and the
loss curve, and a non-finite loss on any rank stops every rank together,
before the model is touched), backward (a `DataParallel` model averages the
gradients as backward returns; a pipeline's step runs forward and backward
of its micro-batches, and the loss is checked before the optimizer step),
unscaling (fp16), clipping by global norm, the optimizer step and the
per-step LR schedule. Per epoch: evaluation with metrics summed across ranks
in one allreduce, and a checkpoint. Every rank runs the same code; only
rank 0 draws the progress bar.

A timeline (`timeline="trace.json"` or HPDL_TIMELINE) records forward,
backward and optimizer spans on `comm.tracer`, where DataParallel records
its bucket allreduces too, and writes one Chrome trace at the end of `fit`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Iterator, Optional

import torch

import hpdl.settings as settings
from hpdl.comm.base import Communicator
from hpdl.comm.trace import Tracer
from hpdl.errors import HpdlError
from hpdl.parallel import DataParallel
from hpdl.parallel.shared import clip_by_global_norm_
from hpdl.runtime.environment import restart_count
from hpdl.train import checkpoint as ckpt
from hpdl.train.progress import Progress
from hpdl.train.sampler import DistributedSampler

if TYPE_CHECKING:
    from hpdl.parallel import Mesh, Plan
    from hpdl.train.plans import MeshLayout

__all__ = ["Trainer", "History", "NonFiniteLossError", "clip_grad_norm_", "PRECISIONS"]

PRECISIONS = ("fp32", "bf16", "fp16")
log = logging.getLogger(__name__)


class NonFiniteLossError(HpdlError):
    """The loss became NaN or infinite; training stopped before the model was updated with it."""

    def __init__(self, message: str, *, epoch: int, step: int, global_step: int, ranks: tuple[int, ...]):
        super().__init__(message)
        self.epoch = epoch
        self.step = step
        self.global_step = global_step
        self.ranks = ranks


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    *,
    comm: Optional[Communicator] = None,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Scale the gradients so that their norm over *all* parameters is at most `max_norm`; return that norm.

    Without `comm` the gradients are taken to be complete on this rank (after
    DataParallel's allreduce they are equal on every rank, so the norm is the
    same everywhere): this is `torch.nn.utils.clip_grad_norm_`. With `comm`,
    the ranks of `comm` hold *disjoint* parts of the parameters, every
    parameter on exactly one rank: the per-rank sums of |g|^p are summed
    across ranks first, so that every rank clips by the same global norm.
    Not for parameters that several ranks hold: tensor-parallel models
    replicate some (layer norms, biases), which this would count once per
    tp rank; use `hpdl.parallel.mesh.clip_grad_norm_(model, max_norm, mesh)`
    there, and a ZeRO optimizer's own `clip_grad_norm_` for ZeRO shards.
    """
    return clip_by_global_norm_(
        [p.grad for p in parameters], max_norm, groups=(comm,) if comm is not None else (), norm_type=norm_type
    )


@dataclass
class History:
    """What `fit` measured: the global mean loss of every step, and one record per epoch."""

    losses: list[float] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)

    def state(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "epochs": [dict(e) for e in self.epochs]}


class Trainer:
    """Runs epochs of training on every rank, for every plan.

    model: a plain module, one wrapped by `hpdl.parallel.DataParallel` or
    ZeRO, or (with `mesh`) what `hpdl.parallel.build` returned, a `Pipeline` included.
    optimizer: any torch optimizer (see `hpdl.train.LARS`, `LAMB`).
    loss_fn: `loss_fn(output, target)` (default cross entropy; with `mesh`,
    over the tp ranks' slices of the classes when the plan splits the head).
    comm: the communicator (default: `hpdl.world()` when initialised, else one process).
    mesh: the `Mesh` the model was built on. Each batch of the loader is then
    this rank's data-parallel replica's (`DistributedSampler(n, mesh.dp)`):
    every rank of a replica (its tp, pp and sp ranks) must read the same
    batches; a spatial model takes its slab of them. Checkpoints are then
    sharded folders (`hpdl.parallel.mesh.state`) that load on any mesh.
    scheduler: an LR scheduler stepped after every optimizer step (`WarmupSchedule`).
    max_grad_norm: clip gradients by their global norm (None: no clipping).
    precision: "fp32", "bf16" (autocast, CPU or GPU) or "fp16" (autocast and a GradScaler; GPU only).
    checkpoint: file to write a checkpoint to at the end of every epoch and,
    with `checkpoint_every`, every that many steps.
    timeline: Chrome-trace file to write at the end of `fit` (default HPDL_TIMELINE).
    progress: draw the bar on rank 0; stream: where (default stdout).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
        comm: Optional[Communicator] = None,
        *,
        scheduler: Any = None,
        max_grad_norm: Optional[float] = None,
        precision: str = "fp32",
        checkpoint: Optional[str] = None,
        checkpoint_every: int = 0,
        timeline: Optional[str] = None,
        progress: bool = True,
        stream: Optional[IO[str]] = None,
        mesh: Optional[Mesh] = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"Trainer: precision={precision!r}; choose one of {', '.join(PRECISIONS)}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"Trainer: max_grad_norm={max_grad_norm} must be positive (or None for no clipping)")
        if checkpoint_every < 0:
            raise ValueError(f"Trainer: checkpoint_every={checkpoint_every} must be >= 0 (0: at epoch ends only)")
        self.model: Any = model
        self.optimizer = optimizer
        self.layout: Optional[MeshLayout] = None
        if mesh is not None:
            from hpdl.train.plans import MeshLayout

            self.layout = MeshLayout(model, mesh)
            if comm is not None and comm.size != mesh.world.size:
                raise ValueError(
                    f"Trainer: comm has {comm.size} ranks but the mesh's world {mesh.world.size}; pass the "
                    "communicator the mesh was made from, or leave comm out"
                )
            comm = comm if comm is not None else mesh.world
        default_loss = self.layout.default_loss() if self.layout is not None else torch.nn.functional.cross_entropy
        self.loss_fn = loss_fn if loss_fn is not None else default_loss
        self.comm = comm if comm is not None else _default_comm()
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.precision = precision
        self.device = _device_of(model)
        if precision == "fp16" and self.device.type != "cuda":
            raise ValueError(
                "Trainer: precision='fp16' needs a GPU (loss scaling guards fp16 gradients there); "
                f"the model is on {self.device}. On CPU use precision='bf16' (no loss scaling needed) or 'fp32'."
            )
        if precision == "fp16" and self.layout is not None and self.layout.pipeline:
            raise ValueError(
                "Trainer: precision='fp16' is not available for a pipeline (its step runs backward); "
                "use precision='bf16' or 'fp32'"
            )
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
        self.checkpoint = checkpoint
        self.checkpoint_every = checkpoint_every
        self.timeline = timeline if timeline is not None else settings.text("HPDL_TIMELINE")
        if self.timeline and self.comm.tracer is None:
            self.comm.tracer = Tracer()
        self.show = progress and self.comm.rank == 0
        self.stream = stream
        self.history = History()
        self.epoch = 0  # the next epoch to run
        self.step_in_epoch = 0  # steps of `epoch` already done (non-zero after a mid-epoch resume)
        self.global_step = 0
        self._pending_rng: Optional[dict[str, Any]] = None
        # DataParallel records its own forward and backward spans (and one per bucket allreduce).
        self._own_spans = not isinstance(model, DataParallel)

    @classmethod
    def from_plan(
        cls,
        model: torch.nn.Module,
        plan: Plan,
        comm: Optional[Communicator] = None,
        *,
        optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
        optimizer_options: Optional[dict[str, Any]] = None,
        **options: Any,
    ) -> Trainer:
        """Check `plan` against this world and `model`, build the mesh and the model on it, and a Trainer.

        `optimizer` is a `torch.optim` class built with `optimizer_options`
        (lr=...) over this rank's parameters; `options` are the Trainer's.
        The mesh is `trainer.layout.mesh`. Collective over `comm`.
        """
        from hpdl.parallel import Mesh, build

        comm = comm if comm is not None else _default_comm()
        plan = plan.validate(comm.size, model)
        mesh = Mesh.from_plan(comm, plan)
        built, opt = build(model, mesh, plan, optimizer=optimizer, **(optimizer_options or {}))
        return cls(built, opt, comm=comm, mesh=mesh, **options)

    # ------------------------------------------------------------------ the loop
    def fit(
        self,
        train_loader: Iterable[Any],
        epochs: int,
        *,
        eval_loader: Optional[Iterable[Any]] = None,
        resume: Optional[str] = None,
    ) -> History:
        """Train until `epochs` epochs are done (counting those of a resumed run); return the history.

        resume: a checkpoint file to continue from, or "auto" for
        `self.checkpoint` when it exists. Every rank must pass the same. A job
        that `hpdl launch --max-restarts` (or torchrun) started again resumes
        as with "auto" unless told otherwise: no code in the script.
        """
        if resume is None and restart_count() > 0:
            resume = "auto"
        if resume == "auto":
            resume = self.checkpoint if self.checkpoint and self._checkpoint_exists(self.checkpoint) else None
        if resume:
            self.restore(resume)
        sampler = _find_sampler(train_loader)
        try:
            while self.epoch < epochs:
                self._run_epoch(train_loader, sampler, epochs, eval_loader)
        finally:
            if self.timeline and self.comm.tracer is not None:
                self.comm.tracer.write(self.timeline, self.comm)
        return self.history

    def _run_epoch(
        self, loader: Iterable[Any], sampler: Optional[DistributedSampler], epochs: int, eval_loader: Any
    ) -> None:
        epoch, skip = self.epoch, self.step_in_epoch
        batches = self._batches(loader, sampler, epoch, skip)
        total = skip + _length(loader)
        bar = Progress(total, desc=f"epoch {epoch + 1}/{epochs}", enabled=self.show, stream=self.stream)
        bar.steps = skip
        self.model.train()
        start, samples, loss_sum, steps = time.perf_counter(), 0, 0.0, 0
        for batch in batches:
            loss, count = self.train_step(batch)
            steps += 1
            samples += count
            loss_sum += loss
            self.step_in_epoch += 1
            bar.update(count, loss)
            if self.checkpoint and self.checkpoint_every and self.global_step % self.checkpoint_every == 0:
                self.save(self.checkpoint, sampler=sampler)
        seconds = time.perf_counter() - start
        record: dict[str, Any] = {
            "epoch": epoch + 1,
            "steps": steps,
            "train_loss": loss_sum / steps if steps else float("nan"),
            "samples": samples,
            "seconds": seconds,
            "samples_per_s": samples / seconds if seconds > 0 else 0.0,
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        summary = ""
        if eval_loader is not None:
            metrics = self.evaluate(eval_loader)
            record.update({f"eval_{k}": v for k, v in metrics.items()})
            summary = "  ".join(
                f"eval {k} {v:.4f}" for k, v in metrics.items() if k in ("loss", "accuracy") and v is not None
            )
        bar.close(summary)
        self.history.epochs.append(record)
        self.epoch, self.step_in_epoch = epoch + 1, 0
        if self.checkpoint:
            self.save(self.checkpoint, sampler=sampler)

    def _batches(
        self, loader: Iterable[Any], sampler: Optional[DistributedSampler], epoch: int, skip: int
    ) -> Iterator[Any]:
        """The epoch's batches from `skip` on (mid-epoch resume), with the saved RNG state restored first."""
        if sampler is not None:
            sampler.set_epoch(epoch)
            batch_size = getattr(loader, "batch_size", None)
            if skip and batch_size:
                sampler.consumed = skip * batch_size
                skip = 0
        iterator = iter(loader)  # a DataLoader draws its base seed here, from the global RNG
        for _ in range(skip):  # no sampler to fast-forward: read and drop the batches already trained on
            next(iterator)
        if self._pending_rng is not None:
            ckpt.set_rng_state(self._pending_rng)
            self._pending_rng = None
        return iterator

    def train_step(self, batch: Any) -> tuple[float, int]:
        """One optimizer step on `batch` (inputs, targets); return the global mean loss and the global sample count."""
        inputs, targets = _to_device(batch, self.device)
        pipeline = self.layout is not None and self.layout.pipeline
        if self.layout is not None:
            inputs = self.layout.local_inputs(inputs)
        if pipeline:  # forward and backward of every micro-batch, the loss relayed to every stage
            with self._span("forward-backward"), self._autocast():
                loss = self.model.step(inputs, targets, self.loss_fn)
        else:
            with self._span("forward", self._own_spans), self._autocast():
                output = self.model(inputs)
                loss = self.loss_fn(output, targets)
        local = torch.tensor([float(loss.detach()), float(_batch_len(targets))], dtype=torch.float64)
        gathered = (
            self.comm.allgather(local.reshape(1, 2), sizes=[1] * self.comm.size)
            if self.comm.size > 1
            else local.reshape(1, 2)
        )
        losses, counts = gathered[:, 0], gathered[:, 1]
        if self.layout is not None:  # every rank of a replica counted its batch: count it once
            counts = counts / self.layout.ranks_per_replica
        if not bool(torch.isfinite(losses).all()):
            if pipeline:
                self.optimizer.zero_grad(set_to_none=True)
            self._non_finite(losses)
        if not pipeline:
            with self._span("backward", self._own_spans):
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.max_grad_norm is not None:
            own = getattr(self.optimizer, "clip_grad_norm_", None)  # ZeRO: sharded gradients, its own global norm
            norm = own(self.max_grad_norm) if own else self._clip(self.max_grad_norm)
            if self.scaler is None and not bool(torch.isfinite(norm)):
                self._non_finite(losses, what=f"gradient norm ({float(norm)})")
        with self._span("optimizer"):
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self.global_step += 1
        mean = float((losses * counts).sum() / counts.sum()) if float(counts.sum()) > 0 else float(losses.mean())
        self.history.losses.append(mean)
        return mean, int(counts.sum())

    def _non_finite(self, losses: torch.Tensor, what: str = "") -> None:
        bad = tuple(int(r) for r in torch.nonzero(~torch.isfinite(losses)).flatten().tolist())
        values = ", ".join(f"rank {r}: {float(losses[r])}" for r in bad) or ", ".join(
            f"rank {r}: {float(v)}" for r, v in enumerate(losses)
        )
        last = next((x for x in reversed(self.history.losses) if math.isfinite(x)), None)
        subject = what or f"the loss is not finite ({values})"
        message = (
            f"{subject} at epoch {self.epoch + 1}, step {self.step_in_epoch + 1} of the epoch (global step "
            f"{self.global_step + 1}); the last finite loss was {last if last is not None else 'none yet'}, "
            f"lr {self.optimizer.param_groups[0]['lr']:.3g}. The model was not updated with it. Try: a lower "
            "learning rate or a longer warm-up, gradient clipping (max_grad_norm=1.0), precision='fp32' or 'bf16' "
            "instead of 'fp16', and check the inputs of that batch for NaN/inf"
            + (f"; resume from the last checkpoint ({self.checkpoint})" if self.checkpoint else "")
            + "."
        )
        raise NonFiniteLossError(
            message, epoch=self.epoch, step=self.step_in_epoch, global_step=self.global_step, ranks=bad
        )

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, loader: Iterable[Any]) -> dict[str, Any]:
        """Mean loss and accuracy over every rank's shard of `loader`, summed across ranks in one allreduce.

        Runs the plain module (no DataParallel hooks), so ranks may hold shards
        of different sizes (`DistributedSampler(..., pad=False)`). With a mesh
        it runs the built model (every rank of a replica reads the same
        batches) and one rank per replica, on the last stage, counts them.
        """
        layout = self.layout
        module: Any = ckpt.unwrap(self.model) if layout is None else self.model
        was_training = module.training if isinstance(module, torch.nn.Module) else True
        module.train(False)
        sums = torch.zeros(4, dtype=torch.float64)  # loss * n, correct, n, classified n
        reports = layout is None or layout.reports()
        try:
            for batch in loader:
                inputs, targets = _to_device(batch, self.device)
                with self._autocast():
                    output = module(inputs) if layout is None else layout.predict(layout.local_inputs(inputs))
                    loss = None if output is None else self.loss_fn(output, targets)  # None: a pipeline's early stage
                if loss is None or not reports:
                    continue
                n = _batch_len(targets)
                sums[0] += float(loss) * n
                sums[2] += n
                whole = layout is None or not layout.output_split
                if whole and isinstance(output, torch.Tensor) and output.dim() == 2 and targets.dim() == 1:
                    sums[1] += float((output.argmax(dim=1) == targets).sum())
                    sums[3] += n
        finally:
            module.train(was_training)
        if self.comm.size > 1:
            self.comm.allreduce(sums, op="sum")
        total = float(sums[2])
        return {
            "loss": float(sums[0]) / total if total else float("nan"),
            "accuracy": float(sums[1]) / float(sums[3]) if float(sums[3]) else None,
            "samples": int(total),
        }

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str, *, sampler: Optional[DistributedSampler] = None) -> None:
        """Checkpoint everything needed to continue this run exactly (collective)."""
        sampler_state = None
        if sampler is not None:
            sampler_state = dict(sampler.state_dict(), epoch=self.epoch, consumed=0)
        if self.layout is not None:
            self.layout.save(path, self.optimizer, self._loop_state(sampler_state))
            return
        ckpt.save(
            path,
            self.model,
            self.optimizer,
            comm=self.comm,
            epoch=self.epoch,
            step=self.global_step,
            scheduler=self.scheduler,
            scaler=self.scaler,
            extra={"step_in_epoch": self.step_in_epoch, "history": self.history.state(), "sampler": sampler_state},
        )

    def restore(self, path: str) -> ckpt.Checkpoint:
        """Load a checkpoint written by `save`; `fit` continues from its epoch and step."""
        if self.layout is not None:
            state = self._restore_loop(path, self.layout.load(path, self.optimizer))
        else:
            state = self._restore_file(path)
        history = state.extra.get("history") or {}
        self.history = History(list(history.get("losses", [])), list(history.get("epochs", [])))
        self.epoch, self.global_step = state.epoch, state.step
        self.step_in_epoch = int(state.extra.get("step_in_epoch", 0))
        self._pending_rng = state.rng
        if self.show:
            log.info("resumed from %s at epoch %d, global step %d", path, self.epoch + 1, self.global_step)
        return state

    def _restore_file(self, path: str) -> ckpt.Checkpoint:
        return ckpt.load(
            path,
            self.model,
            self.optimizer,
            comm=self.comm,
            scheduler=self.scheduler,
            scaler=self.scaler,
            restore_rng=False,
            map_location=self.device,
        )

    def _loop_state(self, sampler_state: Optional[dict[str, Any]]) -> dict[str, Any]:
        """What a mesh checkpoint holds beside the tensors: the loop's position, history, RNG states (collective)."""
        return {
            "epoch": self.epoch,
            "step": self.global_step,
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "rng": self.comm.allgather_object(ckpt.rng_state()),
            "extra": {"step_in_epoch": self.step_in_epoch, "history": self.history.state(), "sampler": sampler_state},
        }

    def _restore_loop(self, path: str, state: dict[str, Any]) -> ckpt.Checkpoint:
        for name, obj in (("scheduler", self.scheduler), ("scaler", self.scaler)):
            if obj is not None:
                if state.get(name) is None:
                    raise ckpt.CheckpointError(f"checkpoint {path} holds no {name} state, but the Trainer has one")
                obj.load_state_dict(state[name])
        states = state.get("rng") or []
        mine = states[self.comm.rank % len(states)] if states else None
        return ckpt.Checkpoint(path, int(state["epoch"]), int(state["step"]), dict(state.get("extra") or {}), mine)

    def _checkpoint_exists(self, path: str) -> bool:
        return self.layout.exists(path) if self.layout is not None else os.path.exists(path)

    def _clip(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm, clipped: over the mesh's axes for a built model (each parameter once)."""
        if self.layout is not None:
            from hpdl.parallel.mesh import clip_grad_norm_ as clip_mesh

            return clip_mesh(self.model, max_norm, self.layout.mesh)
        return clip_grad_norm_(self.model.parameters(), max_norm)

    # ------------------------------------------------------------------ helpers
    def _span(self, name: str, record: bool = True) -> ContextManager[None]:
        tracer = self.comm.tracer
        if tracer is None or not self.timeline or not record:
            return contextlib.nullcontext()
        return tracer.span(name, "compute", step=self.global_step)

    def _autocast(self) -> ContextManager[Any]:
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)


def _default_comm() -> Communicator:
    from hpdl.runtime.world import is_initialized, world

    if is_initialized():
        return world()
    from hpdl.comm.self_backend import SelfCommunicator

    return SelfCommunicator(timeout=300.0, debug=False)


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _find_sampler(loader: Any) -> Optional[DistributedSampler]:
    for candidate in (
        getattr(loader, "sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ):
        if isinstance(candidate, DistributedSampler):
            return candidate
    return None


def _length(loader: Any) -> int:
    try:
        return len(loader)
    except TypeError:
        return 0


def _to_device(batch: Any, device: torch.device) -> tuple[Any, Any]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(f"Trainer: a batch must be (inputs, targets); got {type(batch).__name__}")
    inputs, targets = batch
    if isinstance(inputs, torch.Tensor):
        inputs = inputs.to(device, non_blocking=True)
    if isinstance(targets, torch.Tensor):
        targets = targets.to(device, non_blocking=True)
    return inputs, targets


def _batch_len(targets: Any) -> int:
    return int(targets.shape[0]) if isinstance(targets, torch.Tensor) and targets.dim() > 0 else len(targets)
