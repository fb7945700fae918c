"""`Trainer`: the epoch loop of data-parallel training, with the things every run needs.

Per step: forward (under autocast when asked), the loss of every rank
gathered (one tiny allgather: the global mean for the progress bar and the
loss curve, and a non-finite loss on any rank stops every rank together,
before the model is touched), backward (a `DataParallel` model averages the
gradients as backward returns), unscaling (fp16), clipping by global norm,
the optimizer step and the per-step LR schedule. Per epoch: evaluation with
metrics summed across ranks in one allreduce, and a checkpoint. Every rank
runs the same code; only rank 0 draws the progress bar.

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
from typing import IO, Any, Callable, ContextManager, Iterable, Iterator, Optional

import torch

from hpdl.comm.base import Communicator
from hpdl.comm.trace import Tracer
from hpdl.errors import HpdlError
from hpdl.parallel import DataParallel
from hpdl.parallel.shared import clip_by_global_norm_
from hpdl.runtime.environment import restart_count
from hpdl.train import checkpoint as ckpt
from hpdl.train.progress import Progress
from hpdl.train.sampler import DistributedSampler

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
    """Runs epochs of (data-parallel) training on every rank.

    model: a plain module or one wrapped by `hpdl.parallel.DataParallel`.
    optimizer: any torch optimizer (see `hpdl.train.LARS`, `LAMB`).
    loss_fn: `loss_fn(output, target)` (default cross entropy).
    comm: the communicator (default: `hpdl.world()` when initialised, else one process).
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
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"Trainer: precision={precision!r}; choose one of {', '.join(PRECISIONS)}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"Trainer: max_grad_norm={max_grad_norm} must be positive (or None for no clipping)")
        if checkpoint_every < 0:
            raise ValueError(f"Trainer: checkpoint_every={checkpoint_every} must be >= 0 (0: at epoch ends only)")
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn if loss_fn is not None else torch.nn.functional.cross_entropy
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
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
        self.checkpoint = checkpoint
        self.checkpoint_every = checkpoint_every
        self.timeline = timeline if timeline is not None else (os.environ.get("HPDL_TIMELINE") or None)
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
            resume = self.checkpoint if self.checkpoint and os.path.exists(self.checkpoint) else None
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
        if not bool(torch.isfinite(losses).all()):
            self._non_finite(losses)
        with self._span("backward", self._own_spans):
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.max_grad_norm is not None:
            own = getattr(self.optimizer, "clip_grad_norm_", None)  # ZeRO: sharded gradients, its own global norm
            norm = own(self.max_grad_norm) if own else clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
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
        of different sizes (`DistributedSampler(..., pad=False)`).
        """
        module = ckpt.unwrap(self.model)
        was_training = module.training
        module.eval()
        sums = torch.zeros(4, dtype=torch.float64)  # loss * n, correct, n, classified n
        try:
            for batch in loader:
                inputs, targets = _to_device(batch, self.device)
                with self._autocast():
                    output = module(inputs)
                    loss = self.loss_fn(output, targets)
                n = _batch_len(targets)
                sums[0] += float(loss) * n
                sums[2] += n
                if isinstance(output, torch.Tensor) and output.dim() == 2 and targets.dim() == 1:
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
        state = ckpt.load(
            path,
            self.model,
            self.optimizer,
            comm=self.comm,
            scheduler=self.scheduler,
            scaler=self.scaler,
            restore_rng=False,
            map_location=self.device,
        )
        history = state.extra.get("history") or {}
        self.history = History(list(history.get("losses", [])), list(history.get("epochs", [])))
        self.epoch, self.global_step = state.epoch, state.step
        self.step_in_epoch = int(state.extra.get("step_in_epoch", 0))
        self._pending_rng = state.rng
        if self.show:
            log.info("resumed from %s at epoch %d, global step %d", path, self.epoch + 1, self.global_step)
        return state

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
