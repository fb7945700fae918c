"""`Pipeline`: split a sequential model into stages, one per rank, and train it on micro-batches.

    pipe = hpdl.parallel.Pipeline(model, comm, chunks=8, schedule="1f1b", balance="auto",
                                  checkpoint="except_last", sample=x[:16])
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)   # this rank's stage only
    loss = pipe.step(x, y, loss_fn)                           # every micro-batch forward and backward
    optimizer.step()
    pipe.close()                                              # or: with Pipeline(...) as pipe:

Rank r of `comm` runs stage r. The inputs `x` are read on the first stage
only, the targets `y` and `loss_fn` on the last stage only (other ranks may
pass None); the mean loss comes back on every rank. The parts live beside
this module in `hpdl.parallel.pipe`: schedules, micro-batches, balance,
point-to-point links and the step engine.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from hpdl.comm.base import Communicator
from hpdl.parallel.data import DataParallel
from hpdl.parallel.pipe import balance as balancing
from hpdl.parallel.pipe.engine import PREDICT, TRAIN, StageEngine, StepStats
from hpdl.parallel.pipe.errors import BalanceError, PipelineError, StageFailedError
from hpdl.parallel.pipe.p2p import Link
from hpdl.parallel.pipe.schedule import Schedule

__all__ = ["Pipeline", "PipelineError", "StageFailedError", "BalanceError"]

Model = Union[nn.Sequential, Sequence[Union[nn.Module, Callable[[], nn.Module]]]]


SCHEDULE_CLASSES: dict[str, type[Pipeline]] = {}
"""Schedules that run on a Pipeline class of their own, registered by their module (`gems`), which the
package imports: `Pipeline(..., schedule="gems")` then builds a `GemsPipeline` without this module
importing the one that extends it."""


class Pipeline:
    """This rank's stage of a pipeline over the ranks of `comm` (stage = rank).

    Arguments:
        model: an `nn.Sequential` (or list of modules) that every rank holds,
            or a list of layer factories (zero-argument callables returning a
            module), so that a rank builds only its own layers.
        comm: the pipeline's communicator (a `comm.split` sub-group in a
            dp x pp layout); every rank of it builds the same Pipeline.
        chunks: micro-batches per step (fewer when a batch has fewer rows).
        schedule: "1f1b" (at most p micro-batches of activations per stage),
            "gpipe" (all forwards, then all backwards; m held) or "gems"
            (two mirrored replicas on the same ranks: a `GemsPipeline`,
            `hpdl.parallel.pipe.gems`).
        balance: layer counts per stage, None (equal counts), or "auto":
            each layer timed on `sample` and the layers cut to minimise the
            slowest stage (`hpdl.parallel.pipe.balance`).
        checkpoint: "always", "except_last" (every micro-batch but the last
            is recomputed in backward instead of keeping its activations) or
            "never".
        sample: one micro-batch of inputs (on every rank), for balance="auto".
        seed: with factories, layer j is built under `torch.manual_seed(seed
            + j)`, so its initial weights do not depend on which rank builds it.
        data_parallel: a communicator of this stage's replicas: the stage is
            wrapped in `DataParallel(stage, data_parallel)`.
        wrap_stage: any wrapper of the stage module (ZeRO, a mesh's wrapper).
            When the wrapped module has `no_sync()`, every backward but the
            step's last on this stage runs inside it, so gradients are reduced
            once per step, not once per micro-batch.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Pipeline:
        special = SCHEDULE_CLASSES.get(kwargs.get("schedule", "")) if cls is Pipeline else None
        return super().__new__(special or cls)  # "gems": two mirrored replicas, a class of its own

    def __init__(
        self,
        model: Model,
        comm: Communicator,
        *,
        chunks: int = 8,
        schedule: str = "1f1b",
        balance: Union[None, str, Sequence[int]] = None,
        checkpoint: str = "except_last",
        sample: Any = None,
        seed: Optional[int] = None,
        data_parallel: Optional[Communicator] = None,
        wrap_stage: Optional[Callable[[nn.Module], nn.Module]] = None,
    ):
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks={chunks!r} must be a positive number of micro-batches")
        if data_parallel is not None and wrap_stage is not None:
            raise ValueError("pass data_parallel or wrap_stage, not both (wrap_stage can apply DataParallel itself)")
        layers = _layers(model)
        self.stage, self.stages = comm.rank, comm.size
        self.balance = self._balance(layers, balance, comm, data_parallel, sample, seed)
        start = sum(self.balance[: self.stage])
        self.first_layer = start
        """Index in the model of this stage's first layer."""
        own = [
            balancing.build(spec, start + i, seed)
            for i, spec in enumerate(layers[start : start + self.balance[self.stage]])
        ]
        self.layers = nn.Sequential(*own)
        """This stage's layers as a plain `nn.Sequential` of the model's own modules."""
        if data_parallel is not None:
            self.module: nn.Module = DataParallel(self.layers, data_parallel)
        else:
            self.module = wrap_stage(self.layers) if wrap_stage is not None else self.layers
        if not isinstance(self.module, nn.Module):
            raise TypeError(f"wrap_stage returned {type(self.module).__name__}, not an nn.Module")
        if isinstance(getattr(self.module, "pipeline_stages", None), int):
            # A wrapper that clips over its own ranks (a ZeroModel) must know that it holds one stage of several.
            self.module.__dict__["pipeline_stages"] = self.stages
        # A private communicator: the pipeline's messages never meet the caller's own (`close` frees it).
        private = comm.split(0, comm.rank) if comm.size > 1 else comm
        if private is None:
            raise RuntimeError(f"Pipeline: splitting a private communicator from {comm!r} gave none")
        self.comm = private
        self._owns_comm = private is not comm
        self.closed = False
        self._engine = StageEngine(
            self.module, Link(self.comm, self.stage, self.stages), schedule=schedule, chunks=chunks,
            checkpoint=checkpoint,
        )  # fmt: skip
        self._engine.drive_progress(self.layers)

    @staticmethod
    def _balance(
        layers: list, balance: Any, comm: Communicator, dp: Optional[Communicator], sample: Any, seed: Optional[int]
    ) -> list[int]:
        if balance is None:
            return balancing.even(len(layers), comm.size)
        if isinstance(balance, str):
            if balance != "auto":
                raise BalanceError(f"balance={balance!r}: pass 'auto', None or a list of layer counts per stage")
            if sample is None:
                raise BalanceError(
                    "balance='auto' times every layer on one micro-batch: pass sample=<one micro-batch of inputs> "
                    "(the same shapes on every rank), or give the layer counts, e.g. balance="
                    f"{balancing.even(len(layers), comm.size)}"
                )
            balancing.check_stages(len(layers), comm.size)
            costs = balancing.measure(layers, sample, seed=seed)
            # Every rank measured; the ranks must agree on one split. Each layer's time is the fastest rank's
            # (as `measure` keeps the fastest run: a rank that other work slowed would skew an average).
            seconds = torch.tensor([c.seconds for c in costs], dtype=torch.float64)
            memory = torch.tensor([float(c.memory) for c in costs], dtype=torch.float64)
            for group in (comm, dp):
                if group is not None and group.size > 1:
                    group.allreduce(seconds, "min")
                    group.allreduce(memory, "max")
            return balancing.partition(seconds.tolist(), comm.size, memory=memory.tolist())
        return balancing.check_balance(balance, len(layers), comm.size)

    # ------------------------------------------------------------------ life cycle
    def close(self) -> None:
        """Free the pipeline's private communicator, its buffers and its hooks; idempotent.

        Collective: every stage calls it (closing a communicator meets the
        other ranks, with a bounded wait). The caller's communicator and the
        stage's modules stay usable; this Pipeline does not.
        """
        if self.closed:
            return
        self.closed = True
        self._engine.close()
        if self._owns_comm:
            self.comm.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise PipelineError(f"Pipeline.{what}: this pipeline was closed; build a new Pipeline")

    # ------------------------------------------------------------------ training and inference
    def step(self, x: Any, y: Any, loss_fn: Optional[Callable[[Any, Any], torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the batch's mean loss on every rank (a 0-d tensor).

        Gradients accumulate into this stage's parameters (zero them before,
        step the optimizer after, as for one process). `loss_fn(output, y)`
        should return the mean over its micro-batch: micro-batch losses are
        weighted by their share of the rows, so the gradients are those of
        the whole batch even when the rows do not divide evenly.
        """
        self._check_open("step")
        return torch.tensor(self._engine.run(TRAIN, x, y, loss_fn), dtype=torch.float64)

    @torch.no_grad()
    def predict(self, x: Any) -> Any:
        """The model's output for `x` (without gradients) on the last stage; None on the other stages."""
        self._check_open("predict")
        return self._engine.run(PREDICT, x, None, None)

    forward = predict

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """This stage's parameters (for the optimizer of this rank)."""
        return self.module.parameters(recurse)

    def train(self, mode: bool = True) -> Pipeline:
        self.module.train(mode)
        return self

    def eval(self) -> Pipeline:
        return self.train(False)

    def schedule(self, microbatches: Optional[int] = None) -> Schedule:
        """The schedule object a step of `microbatches` (default: chunks) runs; `.draw()` prints it."""
        return self._engine.schedule(microbatches or self._engine.chunks)

    @property
    def stats(self) -> StepStats:
        """The last step on this stage: peak live micro-batches, compute, wait and step seconds, bubble."""
        return self._engine.stats

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def __repr__(self) -> str:
        return (
            f"Pipeline(stage {self.stage} of {self.stages}, layers {self.first_layer}.."
            f"{self.first_layer + len(self.layers) - 1}, balance={self.balance}, "
            f"schedule={self._engine.schedule_name!r}, chunks={self._engine.chunks}, "
            f"checkpoint={self._engine.checkpoint!r})"
        )


def _layers(model: Any) -> list:
    if isinstance(model, nn.Sequential):
        return list(model.children())
    if isinstance(model, nn.Module):
        raise TypeError(
            f"Pipeline needs an nn.Sequential or a list of layers (or layer factories), got {type(model).__name__}: "
            "write the model as nn.Sequential(...) of its blocks"
        )
    if isinstance(model, (list, tuple)) and model and all(isinstance(m, nn.Module) or callable(m) for m in model):
        return list(model)
    raise TypeError(f"Pipeline needs an nn.Sequential or a non-empty list of modules or factories, got {model!r}")
