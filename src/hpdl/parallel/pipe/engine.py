"""Run one stage's share of a pipeline step: its schedule's forwards and backwards, in order.

Per step, stage 0 cuts the batch into micro-batches and sends a small
header down the pipeline (mode, number of micro-batches, an id of the input
shapes, the batch size, whether those shapes are new). With new shapes,
every activation message is preceded by its shapes (`p2p`); afterwards the
shapes are known and receives are posted one action ahead into pooled
buffers. A stage keeps, per micro-batch in flight, its inputs and outputs
(or, with recomputation, only its inputs and the RNG state) until that
micro-batch's backward: `live` counts them, and `peak_live` is what the
schedule promises (1F1B: at most the number of stages).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from hpdl.parallel.pipe import microbatch
from hpdl.parallel.pipe.errors import PipelineError
from hpdl.parallel.pipe.p2p import TAG_ACTIVATION, TAG_GRADIENT, Link, Spec, describe, gradient_spec, spec_of
from hpdl.parallel.pipe.schedule import Action, Schedule, make_schedule

__all__ = ["StageEngine", "StepStats", "CHECKPOINTS"]

CHECKPOINTS = ("always", "except_last", "never")
TRAIN, PREDICT = 0, 1
_MODES = {TRAIN: "step()", PREDICT: "predict()"}
_SHAPE_WORDS = ("shape", "size", "mat1", "dimension")
LOOKAHEAD = 2
"""Receives posted ahead per direction: the current micro-batch's and the next one's."""


@dataclass
class StepStats:
    """What the last step did on this stage (counted, not estimated)."""

    microbatches: int = 0
    peak_live: int = 0
    """The most micro-batches whose activations this stage held at once."""
    step_seconds: float = 0.0
    compute_seconds: float = 0.0
    """Forward, backward and recomputation on this stage."""
    wait_seconds: float = 0.0
    """Waiting for neighbours (activations, gradients, the end of the step)."""

    @property
    def bubble(self) -> float:
        """The fraction of the step this stage was not computing."""
        return 1.0 - self.compute_seconds / self.step_seconds if self.step_seconds > 0 else 0.0


@dataclass
class _InFlight:
    """What a stage keeps for micro-batch k between its forward and its backward."""

    arg: Any = None
    """The stage's input as the module saw it (tensor or tuple)."""
    inputs: tuple[torch.Tensor, ...] = ()
    buffers: Optional[tuple[torch.Tensor, ...]] = None
    in_spec: Optional[Spec] = None
    outputs: tuple[torch.Tensor, ...] = ()
    loss: Optional[torch.Tensor] = None
    rng: Optional[torch.Tensor] = None
    """CPU RNG state before the forward, when the backward recomputes it."""
    sends: list = field(default_factory=list)
    """(tensor, handle) of the activation sends: a pass-through stage's output is its input buffer."""


class StageEngine:
    """Runs the actions of `stage` for a module that computes that stage (possibly wrapped)."""

    def __init__(self, module: nn.Module, link: Link, *, schedule: str, chunks: int, checkpoint: str):
        if checkpoint not in CHECKPOINTS:
            raise ValueError(f"checkpoint={checkpoint!r}; choose one of {', '.join(map(repr, CHECKPOINTS))}")
        make_schedule(schedule, 1, 1)  # validates the name now, not at the first step
        self.module = module
        self.link = link
        self.stage, self.stages = link.stage, link.stages
        self.first, self.last = link.prev is None, link.next is None
        self.schedule_name = schedule
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.stats = StepStats()
        self.running = False
        self._shape_ids: dict[Any, int] = {}
        self._in_specs: dict[tuple[int, int], Spec] = {}
        self._out_specs: dict[tuple[int, int], Spec] = {}
        self._schedules: dict[int, Schedule] = {}

    def drive_progress(self, layers: nn.Module) -> None:
        """On MPI, test messages in flight between layers in forward and backward (transfers overlap compute).

        The hooks sit on the user's own modules: they hold this engine weakly
        and do nothing outside a step (or once the pipeline is gone).
        """
        if not self.link.polling:
            return
        engine = weakref.ref(self)

        def on_grad(grad: torch.Tensor) -> None:
            alive = engine()
            if alive is not None:
                alive.link.progress()

        def after_layer(module: nn.Module, args: Any, output: Any) -> None:
            alive = engine()
            if alive is None or not alive.running:
                return
            alive.link.progress()
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(on_grad)

        self._hooks = [layer.register_forward_hook(after_layer) for layer in layers.children()]

    def close(self) -> None:
        """Remove the hooks from the user's modules and drop the link's buffers (the pipeline is done)."""
        for handle in getattr(self, "_hooks", ()):
            handle.remove()
        self._hooks = []
        self.link.close()

    def __del__(self) -> None:
        for handle in getattr(self, "_hooks", ()):
            handle.remove()

    def schedule(self, microbatches: int) -> Schedule:
        if microbatches not in self._schedules:
            self._schedules[microbatches] = make_schedule(self.schedule_name, self.stages, microbatches)
        return self._schedules[microbatches]

    # ------------------------------------------------------------------ one step
    def run(self, mode: int, x: Any, y: Any, loss_fn: Optional[Callable[[Any, Any], torch.Tensor]]) -> Any:
        """Run one step (TRAIN: forward and backward, returns the mean loss) or PREDICT (outputs on the last stage)."""
        started = time.perf_counter()
        self.link.begin()
        self.running = True
        try:
            result = self._run(mode, x, y, loss_fn)
            loss = self.link.finish(result if mode == TRAIN else 0.0)
        except BaseException as error:
            self.link.fail(error)
            raise
        finally:
            self.running = False
        self.stats.step_seconds = time.perf_counter() - started
        self.stats.wait_seconds = self.link.wait_seconds
        return loss if mode == TRAIN else result

    def _run(self, mode: int, x: Any, y: Any, loss_fn: Any) -> Any:
        return self.prepare(mode, x, y, loss_fn).go(self.stats)

    def prepare(self, mode: int, x: Any, y: Any, loss_fn: Any) -> _Step:
        """Exchange the step header and cut the batch: the step, ready to run action by action (`_Step.do`)."""
        header = self._header(mode, x)
        _, m, shapes_id, rows, new, _ = header
        if header[0] != mode:
            raise PipelineError(
                f"stage {self.stage}{self.link.replica} called {_MODES[mode]} while stage 0 called "
                f"{_MODES[header[0]]}: every rank "
                "of the pipeline must call the same method in the same order"
            )
        xs = microbatch.split(x, self.chunks, "x") if self.first else [None] * m
        ys: list[Any] = [None] * m
        if self.last and mode == TRAIN:
            if y is None or loss_fn is None:
                raise PipelineError(
                    f"the last stage{self.link.replica} (rank {self.link.ranks[self.stage]}) needs the targets y and "
                    "loss_fn in step(x, y, loss_fn); other stages may pass None for y"
                )
            if microbatch.batch_size(y, "y") != rows:
                raise PipelineError(
                    f"y has {microbatch.batch_size(y, 'y')} rows on the last stage but x has {rows} on the first; "
                    "pass the targets of the same batch"
                )
            ys = microbatch.split(y, self.chunks, "y")
        weights = [n / rows for n in microbatch.sizes(rows, self.chunks)]
        self.stats = StepStats(microbatches=m)
        run = _Step(self, mode, m, shapes_id, bool(new), xs, ys, weights, loss_fn)
        run.rows = rows
        return run

    def _header(self, mode: int, x: Any) -> list[int]:
        if self.first:
            if x is None:
                raise PipelineError("the first stage (rank 0 of the pipeline) needs the inputs x; got None")
            rows = microbatch.batch_size(x, "x")
            key = (spec_of(microbatch.as_tensors(x, "x")), self.chunks)
            new = key not in self._shape_ids
            if new:
                self._shape_ids[key] = len(self._shape_ids)
            words = [mode, len(microbatch.sizes(rows, self.chunks)), self._shape_ids[key], rows, int(new), 0]
        else:
            words = self.link.recv_header()
        self.link.send_header(words)
        return words


class _Step:
    """The state of one step on one stage (kept out of `StageEngine` so nothing leaks between steps)."""

    def __init__(
        self, engine: StageEngine, mode: int, m: int, shapes_id: int, new: bool, xs: list, ys: list, weights: list,
        loss_fn: Any,
    ):  # fmt: skip
        self.e = engine
        self.link = engine.link
        self.mode = mode
        self.m = m
        self.shapes_id = shapes_id
        self.new = new
        self.xs, self.ys, self.weights = xs, ys, weights
        self.loss_fn = loss_fn
        self.rows = 0
        self.actions = engine.schedule(m).actions(engine.stage) if mode == TRAIN else [Action("F", k) for k in range(m)]
        self.inbox: dict[int, tuple[Spec, tuple[torch.Tensor, ...], list]] = {}
        self.gradbox: dict[int, tuple[Spec, tuple[torch.Tensor, ...], list]] = {}
        self.flight: dict[int, _InFlight] = {}
        self.live = 0
        self.loss = 0.0
        self.outputs: list[Any] = []
        last_backward = [i for i, a in enumerate(self.actions) if a.kind == "B"]
        self.last_backward = last_backward[-1] if last_backward else -1

    def go(self, stats: StepStats) -> Any:
        for index in range(len(self.actions)):
            self.do(index, stats)
        return self.result()

    def do(self, index: int, stats: StepStats) -> None:
        """Run action `index` of this stage's list (its receives posted ahead first)."""
        self.stats = stats
        action = self.actions[index]
        self._prefetch(index)
        if action.kind == "F":
            self._forward(action.microbatch)
        else:
            self._backward(action.microbatch, index == self.last_backward)
        self.link.reap()
        self._prefetch_parameters(index + 1)

    def _prefetch_parameters(self, index: int) -> None:
        """Tell a stage that gathers its parameters (ZeRO-3's `prefetch_for`) what action comes next, so that
        the gather of its first unit overlaps the wait for that action's activations or gradients."""
        hint = getattr(self.e.module, "prefetch_for", None)
        if hint is None or index >= len(self.actions):
            return
        action = self.actions[index]
        item = self.flight.get(action.microbatch)
        recomputes = item is not None and item.rng is not None
        hint("forward" if action.kind == "F" or recomputes else "backward")

    def result(self) -> Any:
        """After the last action: the weighted loss (train) or the joined outputs on the last stage (predict)."""
        if self.mode == PREDICT:
            return microbatch.join(self.outputs) if self.e.last else None
        return self.loss

    # ------------------------------------------------------------------ receives, posted ahead
    def _prefetch(self, index: int) -> None:
        """Post the receives of the next LOOKAHEAD forwards and backwards from `index` on, into pooled buffers.

        Posting the receive of the micro-batch after the current one lets its
        transfer overlap the current compute; the buffers are reused every step.
        Receives of one direction are always posted in the order the neighbour
        sends (MPI matches same-tag messages in posting order).
        """
        want_f = LOOKAHEAD if not self.e.first else 0
        want_b = LOOKAHEAD if not self.e.last and self.mode == TRAIN else 0
        for action in self.actions[index : index + 3 * LOOKAHEAD]:
            k = action.microbatch
            if action.kind == "F" and want_f:
                want_f -= 1
                spec = self.e._in_specs.get((self.shapes_id, k))
                if k in self.inbox:
                    continue
                if spec is None or self.new:  # shapes still unknown: received in order inside the forward
                    want_f = 0
                    continue
                self.inbox[k] = (spec, *self.link.post(spec, self.link.prev, TAG_ACTIVATION))  # type: ignore[arg-type]
            elif action.kind == "B" and want_b:
                want_b -= 1
                out = self.e._out_specs.get((self.shapes_id, k))
                if k in self.gradbox:
                    continue
                if out is None or k not in self.flight:  # its forward has not run: post nothing beyond it (order)
                    want_b = 0
                    continue
                spec = gradient_spec(out)
                self.gradbox[k] = (spec, *self.link.post(spec, self.link.next, TAG_GRADIENT))  # type: ignore[arg-type]

    def _receive_activation(self, k: int) -> tuple[Spec, tuple[torch.Tensor, ...]]:
        if k not in self.inbox:
            key = (self.shapes_id, k)
            if self.new:
                self.e._in_specs[key] = self.link.recv_meta()
            spec = self.e._in_specs[key]
            self.inbox[k] = (spec, *self.link.post(spec, self.link.prev, TAG_ACTIVATION))  # type: ignore[arg-type]
        spec, buffers, works = self.inbox.pop(k)
        self.link.wait(works, f"the activations of micro-batch {k}", self.link.prev)
        return spec, buffers

    # ------------------------------------------------------------------ forward
    def _forward(self, k: int) -> None:
        e, item = self.e, _InFlight()
        if e.first:
            item.arg = self.xs[k]
        else:
            item.in_spec, item.buffers = self._receive_activation(k)
            item.inputs = tuple(_leaf(b, self.mode == TRAIN) for b in item.buffers)
            item.arg = item.inputs[0] if len(item.inputs) == 1 else item.inputs
        recompute = self.mode == TRAIN and (
            e.checkpoint == "always" or (e.checkpoint == "except_last" and k != self.m - 1)
        )
        started = time.perf_counter()
        if recompute:
            item.rng = torch.get_rng_state()
        grad = self.mode == TRAIN and not recompute
        with torch.set_grad_enabled(grad):
            out = self._call(item, k)
            if e.last and self.mode == TRAIN:
                loss = self.loss_fn(out, self.ys[k])
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise PipelineError(f"loss_fn must return a one-element tensor, got {loss!r}")
                self.loss += float(loss.detach()) * self.weights[k]
                item.loss = loss if grad else None
        self.stats.compute_seconds += time.perf_counter() - started
        if e.last:
            if self.mode == PREDICT:
                self.outputs.append(out)
        else:
            outs = tuple(t.contiguous() for t in microbatch.as_tensors(out, f"stage {e.stage}'s output"))
            self._check_outputs(k, outs)
            item.sends = self.link.send([t.detach() for t in outs], self.link.next, TAG_ACTIVATION)  # type: ignore[arg-type]
            item.outputs = outs if grad else ()
        if self.mode == PREDICT:
            if item.buffers is not None:
                self.link.release(item.in_spec, item.buffers, item.sends)  # type: ignore[arg-type]
            return
        self.flight[k] = item
        self.live += 1
        self.stats.peak_live = max(self.stats.peak_live, self.live)

    def _call(self, item: _InFlight, k: int) -> Any:
        try:
            return self.e.module(item.arg)
        except RuntimeError as error:
            if self.e.first or not any(word in str(error) for word in _SHAPE_WORDS):
                raise
            raise PipelineError(
                f"stage {self.e.stage} cannot take what stage {self.e.stage - 1} sends for micro-batch {k} "
                f"({describe(item.in_spec or ())}): {error}. The last layer of stage {self.e.stage - 1} and the "
                f"first layer of stage {self.e.stage} must fit: check the model, or move the boundary (balance)."
            ) from error

    def _check_outputs(self, k: int, outs: tuple[torch.Tensor, ...]) -> None:
        key = (self.shapes_id, k)
        spec = spec_of(outs)
        if self.new:
            self.e._out_specs[key] = spec
            self.link.send_meta(spec)
        elif self.e._out_specs.get(key) != spec:
            raise PipelineError(
                f"stage {self.e.stage} produced {describe(spec)} for micro-batch {k}, but for inputs of these shapes "
                f"it produced {describe(self.e._out_specs.get(key, ()))} before. The shapes between stages must "
                "follow from the input shapes alone (pad data-dependent shapes to a fixed size)."
            )

    # ------------------------------------------------------------------ backward
    def _backward(self, k: int, synced: bool) -> None:
        e, item = self.e, self.flight.pop(k)
        grads: tuple[torch.Tensor, ...] = ()
        if not e.last:
            if k not in self.gradbox:
                self._prefetch_one_gradient(k)
            spec, grads, works = self.gradbox.pop(k)
            grad_spec = spec
        started = time.perf_counter()
        if item.rng is not None:  # recompute the forward, with the RNG as it was (dropout masks agree)
            if not e.first:
                item.inputs = tuple(_leaf(b, True) for b in item.buffers)  # type: ignore[union-attr]
                item.arg = item.inputs[0] if len(item.inputs) == 1 else item.inputs
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(item.rng)
                out = e.module(item.arg)
                if e.last:
                    item.loss = self.loss_fn(out, self.ys[k])
                else:
                    item.outputs = microbatch.as_tensors(out, "output")
        if not e.last:
            started_wait = time.perf_counter()
            self.link.wait(works, f"the gradients of micro-batch {k}", self.link.next)
            started += time.perf_counter() - started_wait
        no_sync = getattr(e.module, "no_sync", None)  # DataParallel, ZeRO: reduce once per step, not per micro-batch
        with no_sync() if no_sync is not None and not synced else contextlib.nullcontext():
            if e.last:
                torch.autograd.backward(item.loss * self.weights[k])  # type: ignore[operator]
            else:
                floating = [t for t in item.outputs if t.dtype.is_floating_point or t.dtype.is_complex]
                pairs = [(t, g) for t, g in zip(floating, grads) if t.requires_grad]
                if pairs:
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        self.stats.compute_seconds += time.perf_counter() - started
        sent: list = []
        if not e.first:
            back = [
                t.grad if t.grad is not None else torch.zeros_like(t)
                for t in item.inputs
                if t.dtype.is_floating_point or t.dtype.is_complex
            ]
            sent = self.link.send(back, self.link.prev, TAG_GRADIENT)  # type: ignore[arg-type]
            self.link.release(item.in_spec, item.buffers, item.sends + sent)  # type: ignore[arg-type]
        if not e.last:
            self.link.release(grad_spec, grads, sent)
        self.live -= 1

    def _prefetch_one_gradient(self, k: int) -> None:
        spec = gradient_spec(self.e._out_specs[(self.shapes_id, k)])
        self.gradbox[k] = (spec, *self.link.post(spec, self.link.next, TAG_GRADIENT))  # type: ignore[arg-type]


def _leaf(buffer: torch.Tensor, grad: bool) -> torch.Tensor:
    """A received tensor as a fresh autograd leaf (a view of the pooled buffer) that collects its gradient."""
    leaf = buffer.detach()
    if grad and (leaf.dtype.is_floating_point or leaf.dtype.is_complex):
        leaf.requires_grad_(True)
    return leaf
