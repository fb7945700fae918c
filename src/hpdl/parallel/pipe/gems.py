"""GEMS-MASTER: two replicas of a pipeline on the same ranks, stages mirrored, bubbles filled by each other.

    pipe = Pipeline(model, comm, schedule="gems", chunks=8)   # a GemsPipeline
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)    # both copies this rank holds
    loss = pipe.step(x, y, loss_fn)                           # x and y on ranks 0 and p-1

Rank r holds stage r of replica A and stage p-1-r of replica B (its
"mirror" stage). Replica A takes the first ceil(B/2) rows of the batch
(entering at rank 0), replica B the rest (entering at rank p-1); each runs
half of the micro-batches, and every rank runs the merged order of
`GemsSchedule` (two ordinary stage engines, one per replica, each over its
own private communicator, driven action by action from one loop).

The two copies of a stage live on the partner ranks r and p-1-r. As soon
as a copy's last backward of the step has run, its gradient (weighted by
its replica's share of the rows) leaves for the partner, overlapping the
rest of the step; at the end each copy gets the sum, so both copies take
the same optimizer step and stay equal (on an odd number of ranks the
middle rank holds both copies of its stage and adds them itself). Where
the partners share a node (MPI with shared memory), the gradients are
packed into a shared window instead and each rank of a pair adds half of
each stage's elements, writing the sum into both copies: no message
carries them, and the summed window becomes the parameters' `.grad`. With
`data_parallel=` the summed gradients are then averaged over that group in
one allreduce.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from hpdl.comm.base import Communicator
from hpdl.parallel.pipe import balance as balancing
from hpdl.parallel.pipe import microbatch
from hpdl.parallel.pipe.engine import PREDICT, TRAIN, StageEngine
from hpdl.parallel.pipe.errors import PipelineError, StageFailedError
from hpdl.parallel.pipe.gems_schedule import GemsSchedule
from hpdl.parallel.pipe.p2p import Link
from hpdl.parallel.pipe.pipeline import SCHEDULE_CLASSES, Pipeline, _layers

__all__ = ["GemsPipeline", "GemsStats"]

TAG_PARAMS, TAG_GRAD_OF_A, TAG_GRAD_OF_B, TAG_PACKED, TAG_SUMMED = 50, 51, 52, 53, 54
"""Between partner ranks: the initial weights; the gradients of replica A's / B's copy of a stage; (in shared
memory) "my copies' gradients are packed" and "my halves of the sums are written"."""
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass
class GemsStats:
    """The last step on this rank, both replicas together (counted, not estimated)."""

    microbatches: int = 0
    peak_live: int = 0
    """The most micro-batches (of both replicas) whose activations this rank held at once."""
    actions: tuple = ()
    """The actions this rank ran, in order (equal to `schedule(m).actions(rank)`)."""
    step_seconds: float = 0.0
    compute_seconds: float = 0.0
    wait_seconds: float = 0.0
    reduce_seconds: float = 0.0
    """Waiting for the partner's gradients and the data-parallel allreduce, after the last action."""

    @property
    def bubble(self) -> float:
        return 1.0 - self.compute_seconds / self.step_seconds if self.step_seconds > 0 else 0.0


class GemsPipeline(Pipeline):
    """This rank's two stages of a GEMS-MASTER pipeline: stage r of replica A, stage p-1-r of replica B.

    Built by `Pipeline(..., schedule="gems")`. Arguments as for `Pipeline`
    (`chunks` counts the micro-batches of both replicas: an even number),
    except `wrap_stage`, which it does not take: the copies' gradients are
    reduced here (and over `data_parallel`).
    """

    def __init__(  # noqa: PLR0913 - the Pipeline signature
        self,
        model: Any,
        comm: Communicator,
        *,
        chunks: int = 8,
        schedule: str = "gems",
        balance: Union[None, str, Sequence[int]] = None,
        checkpoint: str = "except_last",
        sample: Any = None,
        seed: Optional[int] = None,
        data_parallel: Optional[Communicator] = None,
        wrap_stage: Optional[Callable[[nn.Module], nn.Module]] = None,
    ):
        if schedule != "gems":
            raise ValueError(f"GemsPipeline runs schedule='gems', got {schedule!r}; use Pipeline for the others")
        if not isinstance(chunks, int) or chunks < 2 or chunks % 2:
            raise ValueError(
                f"chunks={chunks!r}: the gems schedule splits the micro-batches between two replicas; pass an even "
                "number >= 2"
            )
        if wrap_stage is not None:
            raise ValueError(
                "schedule='gems' reduces the gradients of a stage's two copies itself and takes no wrap_stage; "
                "pass data_parallel=<group> for GEMS x data parallelism"
            )
        layers = _layers(model)
        self.stage, self.stages = comm.rank, comm.size
        self.mirror_stage = self.stages - 1 - self.stage
        """The stage of replica B that this rank holds."""
        self.partner = self.mirror_stage
        """The rank holding the other copies of this rank's two stages."""
        self.dp = data_parallel
        self.balance = self._balance(layers, balance, comm, data_parallel, sample, seed)
        self.first_layer = sum(self.balance[: self.stage])
        self.mirror_first_layer = sum(self.balance[: self.mirror_stage])
        self.layers = self._build(layers, self.stage, seed)
        """This rank's stage of replica A (stage = rank), a plain `nn.Sequential` of the model's modules."""
        if self.mirror_stage == self.stage:
            self.mirror_layers = copy.deepcopy(self.layers)
        else:
            self.mirror_layers = self._build(layers, self.mirror_stage, seed)
        """This rank's stage of replica B (stage p-1-rank)."""
        self.module = self.layers
        comm_a = comm.split(0, self.stage) if comm.size > 1 else comm
        comm_b = comm.split(0, self.mirror_stage) if comm.size > 1 else comm
        if comm_a is None or comm_b is None:
            raise RuntimeError(f"GemsPipeline: splitting private communicators from {comm!r} gave none")
        self.comm, self.mirror_comm = comm_a, comm_b
        self._owns_comm = comm_a is not comm
        self.closed = False
        self._sync_copies()
        link_a = Link(comm_a, self.stage, self.stages, replica=" of replica A")
        mirrored = [self.stages - 1 - s for s in range(self.stages)]  # replica B's stage s runs on rank p-1-s
        link_b = Link(comm_b, self.mirror_stage, self.stages, replica=" of replica B", ranks=mirrored)
        self._engines = (
            StageEngine(self.layers, link_a, schedule="1f1b", chunks=chunks // 2, checkpoint=checkpoint),
            StageEngine(self.mirror_layers, link_b, schedule="1f1b", chunks=chunks // 2, checkpoint=checkpoint),
        )
        self._engine = self._engines[0]
        for engine, stage_layers in zip(self._engines, (self.layers, self.mirror_layers)):
            engine.drive_progress(stage_layers)
        self.chunks = chunks
        self._schedules: dict[int, GemsSchedule] = {}
        self._stats = GemsStats()
        self._exchange_buffers: dict[tuple, torch.Tensor] = {}
        self._shared_grads = self._shared_gradient_buffers()

    def _build(self, layers: list, stage: int, seed: Optional[int]) -> nn.Sequential:
        start = sum(self.balance[:stage])
        return nn.Sequential(
            *[
                balancing.build(spec, start + i, seed)
                for i, spec in enumerate(layers[start : start + self.balance[stage]])
            ]
        )

    def _sync_copies(self) -> None:
        """Replica B's copy of each stage starts as replica A's (factories without a seed may differ)."""
        mine = [t.detach() for t in (*self.layers.parameters(), *self.layers.buffers())]
        mirror = [t.detach() for t in (*self.mirror_layers.parameters(), *self.mirror_layers.buffers())]
        if self.partner == self.stage:
            with torch.no_grad():
                for dst, src in zip(mirror, mine):
                    dst.copy_(src)
            return
        if not mine and not mirror:
            return
        box: Optional[torch.Tensor] = None
        works = []
        if mirror:
            box = torch.empty(sum(t.numel() for t in mirror), dtype=_common_dtype(mirror))
            works.append(self.comm.recv(box, self.partner, tag=TAG_PARAMS, async_op=True))
        if mine:
            works.append(self.comm.send(_flat(mine), self.partner, tag=TAG_PARAMS, async_op=True))
        for work in works:
            work.wait(timeout=self.comm.timeout)
        if box is not None:
            with torch.no_grad():
                _unflat(box, mirror)

    def _shared_gradient_buffers(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(this rank's, its partner's) flat gradient buffers [copy of replica A | copy of replica B] in shared
        memory, when every pair of partners shares a node and every copy's parameters are of one CPU float dtype;
        else None (the gradients then travel as messages). Collective over the pipeline's ranks."""
        params = [p for copy in _trainable(self) for p in copy]
        kinds = {(p.dtype, p.device.type) for p in params}
        if not kinds:  # no gradients on this rank: agrees with any dtype
            low, high = len(_DTYPES), -1
        elif kinds <= {(dtype, "cpu") for dtype in _DTYPES} and len(kinds) == 1:
            ((dtype, _),) = kinds
            low = high = _DTYPES.index(dtype)
        else:  # mixed dtypes, or not on the CPU: no rank takes the shared path
            low, high = -1, len(_DTYPES)
        probe = self.comm.shared_buffer(1, torch.float32)  # (starts the node's shared memory on every rank)
        paired = self.partner == self.stage or self.comm.peer_buffer(probe, self.partner) is not None
        votes = torch.tensor([_numel(params), high, -low, 0 if paired else 1], dtype=torch.int64)
        self.comm.allreduce(votes, "max")
        numel, high, low, unpaired = int(votes[0]), int(votes[1]), -int(votes[2]), int(votes[3])
        if unpaired or high != low or high < 0 or self.comm.size == 1:  # (one dtype everywhere: high == low)
            return None
        mine = self.comm.shared_buffer(numel, _DTYPES[high])
        theirs = mine if self.partner == self.stage else self.comm.peer_buffer(mine, self.partner)
        return (mine, theirs) if theirs is not None else None

    # ------------------------------------------------------------------ life cycle
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for engine in self._engines:
            engine.close()
        if self._owns_comm:
            self.comm.close()
            self.mirror_comm.close()

    # ------------------------------------------------------------------ training
    def step(self, x: Any, y: Any, loss_fn: Optional[Callable[[Any, Any], torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of both replicas' micro-batches; the copies' gradients summed; the batch's mean loss.

        `x` is read on ranks 0 and p-1 (replica A's and B's first stages),
        `y` and `loss_fn` on ranks p-1 and 0 (their last stages).
        """
        self._check_open("step")
        started = time.perf_counter()
        x_a, x_b = _halves(x, "x") if self.stage in (0, self.stages - 1) else (None, None)
        y_a, y_b = _halves(y, "y") if y is not None else (None, None)
        engine_a, engine_b = self._engines
        links = [engine.link for engine in self._engines]
        for link in links:
            link.begin()
        for engine in self._engines:
            engine.running = True
        current = links[0]  # the replica whose work runs now: a failure is named after its stage
        try:
            run_a = engine_a.prepare(TRAIN, x_a if self.stage == 0 else None, y_a, loss_fn)
            current = links[1]
            run_b = engine_b.prepare(TRAIN, x_b if self.stage == self.stages - 1 else None, y_b, loss_fn)
            m = run_a.m + run_b.m
            schedule = self.schedule(m)
            if schedule.split != (run_a.m, run_b.m):  # pragma: no cover - halves and chunks guarantee it
                raise PipelineError(f"gems: replica micro-batches {run_a.m, run_b.m} are not {schedule.split}")
            runs = (run_a, run_b)
            for replica, run in enumerate(runs):
                run.actions = schedule.replica_actions(replica, self.stage)
                run.last_backward = len(run.actions) - 1
            stats = self._stats = GemsStats(microbatches=m)
            shared = self._shared_grads
            exchange = _SharedExchange(self, *shared) if shared is not None else _Exchange(self)
            done, ran = [0, 0], []
            for action in schedule.actions(self.stage):
                replica = action.replica  # type: ignore[attr-defined]
                run, engine, current = runs[replica], self._engines[replica], links[replica]
                run.do(done[replica], engine.stats)
                done[replica] += 1
                ran.append(action)
                stats.peak_live = max(stats.peak_live, run_a.live + run_b.live)
                if done[replica] == len(run.actions):
                    exchange.start(replica, run.rows / (run_a.rows + run_b.rows))
            current = links[0]
            loss_a = links[0].finish(run_a.result())
            current = links[1]
            loss_b = links[1].finish(run_b.result())
            reduce_started = time.perf_counter()
            exchange.finish()
            stats.reduce_seconds = time.perf_counter() - reduce_started
        except BaseException as error:
            notice = error if isinstance(error, StageFailedError) else current.failure(error)
            for link in links:  # both replicas' neighbours hear of it, under the stage where it happened
                link.fail(notice)
            raise
        finally:
            for engine in self._engines:
                engine.running = False
        stats.actions = tuple(ran)
        stats.compute_seconds = sum(e.stats.compute_seconds for e in self._engines)
        stats.wait_seconds = sum(link.wait_seconds for link in links)
        stats.step_seconds = time.perf_counter() - started
        rows_a, rows_b = run_a.rows, run_b.rows
        return torch.tensor((loss_a * rows_a + loss_b * rows_b) / (rows_a + rows_b), dtype=torch.float64)

    @torch.no_grad()
    def predict(self, x: Any) -> Any:
        """The output for `x` through replica A (rank 0 reads x): on the last rank, None elsewhere."""
        self._check_open("predict")
        return self._engines[0].run(PREDICT, x if self.stage == 0 else None, None, None)

    forward = predict

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """Both copies this rank holds (stage r of replica A, then stage p-1-r of replica B)."""
        yield from self.layers.parameters(recurse)
        yield from self.mirror_layers.parameters(recurse)

    def train(self, mode: bool = True) -> GemsPipeline:
        self.layers.train(mode)
        self.mirror_layers.train(mode)
        return self

    def schedule(self, microbatches: Optional[int] = None) -> GemsSchedule:  # type: ignore[override]
        m = microbatches or self.chunks
        if m not in self._schedules:
            self._schedules[m] = GemsSchedule(self.stages, m)
        return self._schedules[m]

    @property
    def stats(self) -> GemsStats:  # type: ignore[override]
        return self._stats

    @property
    def gradient_exchange(self) -> str:
        """How the two copies of this rank's stages are summed: "shared memory" (the partner's window is read
        and written here), "messages" (sent to the partner), or "local" (one rank: it holds both copies)."""
        if self.stages == 1:
            return "local"
        return "shared memory" if self._shared_grads is not None else "messages"

    @property
    def is_first(self) -> bool:
        """Whether this rank reads `x` in `step` (the first stage of replica A or of replica B)."""
        return self.stage in (0, self.stages - 1)

    @property
    def is_last(self) -> bool:
        """Whether this rank reads `y` in `step` (the last stage of replica A or of replica B)."""
        return self.stage in (0, self.stages - 1)

    def __repr__(self) -> str:
        return (
            f"GemsPipeline(rank {self.stage} of {self.stages}: stage {self.stage} of replica A and stage "
            f"{self.mirror_stage} of replica B, balance={self.balance}, chunks={self.chunks}, "
            f"checkpoint={self._engine.checkpoint!r})"
        )


class _Exchange:
    """The gradients of this rank's two copies to and from the partner, started as soon as each copy is done.

    The flat buffers are the pipeline's, kept from step to step (a large stage's are tens of megabytes: fresh
    ones every step cost page faults), and every pass over them is in place: pack, scale, add the partner's.
    """

    def __init__(self, pipe: GemsPipeline):
        self.pipe = pipe
        self.params = _trainable(pipe)
        self.mine: list[Optional[torch.Tensor]] = [None, None]
        self.works: list = []
        self.inbox: list[Optional[torch.Tensor]] = [None, None]
        self.local = pipe.partner == pipe.stage
        if not self.local:  # the partner's copy of my stage comes with the other replica's tag
            comm = pipe.comm
            for replica, tag in ((0, TAG_GRAD_OF_B), (1, TAG_GRAD_OF_A)):
                if self.params[replica]:
                    box = self._buffer(("inbox", replica), self.params[replica])
                    self.inbox[replica] = box
                    self.works.append(comm.recv(box, pipe.partner, tag=tag, async_op=True))

    def _buffer(self, key: tuple, params: list) -> torch.Tensor:
        buffers = self.pipe._exchange_buffers
        numel, dtype = _numel(params), _common_dtype(params)
        found = buffers.get(key)
        if found is None or found.numel() != numel or found.dtype != dtype:
            found = buffers[key] = torch.empty(numel, dtype=dtype)
        return found

    def start(self, replica: int, share: float) -> None:
        """Replica `replica`'s copy has its step's gradient: weight it by the replica's share of rows, send it."""
        params = self.params[replica]
        if not params:
            return
        flat = self._buffer(("mine", replica), params)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        _flat(grads, out=flat).mul_(share)
        self.mine[replica] = flat
        if not self.local:
            tag = TAG_GRAD_OF_A if replica == 0 else TAG_GRAD_OF_B
            self.works.append(self.pipe.comm.send(flat, self.pipe.partner, tag=tag, async_op=True))

    def finish(self) -> None:
        link = self.pipe._engines[0].link
        link.wait(self.works, "the gradients of the mirrored copies", self.pipe.partner)
        if self.local:  # the middle rank of an odd pipeline holds both copies of its stage
            both = [t.clone() if t is not None else None for t in (self.mine[1], self.mine[0])]
            self.inbox = both
        summed = []
        for replica in (0, 1):
            mine, theirs = self.mine[replica], self.inbox[replica]
            if mine is not None and theirs is not None:
                summed.append((replica, mine.add_(theirs)))  # the partner adds the same two: equal copies
        if not summed:
            return
        dp = self.pipe.dp
        if dp is not None and dp.size > 1:
            total = torch.cat([t for _, t in summed]) if len(summed) > 1 else summed[0][1]
            dp.allreduce(total, "avg")
            offset = 0
            for replica, t in summed:
                _set_grads(total[offset : offset + t.numel()], self.params[replica])
                offset += t.numel()
            return
        for replica, t in summed:
            _set_grads(t, self.params[replica])


class _SharedExchange:
    """The exchange where the partners share a node: each copy's gradient, weighted, is packed into this rank's
    shared buffer; then each rank of the pair adds half of every stage's elements (the lower rank the first
    half) and writes the sum into both copies, so both hold the same bits without a message of gradients.

    The partner's buffer is [its copy of replica A (my replica B's stage) | its copy of replica B (my replica
    A's stage)]: my A pairs with its B, my B with its A. Two small messages each way bound the window in which
    the partner's memory is touched; afterwards the parameters' `.grad` are views of this rank's buffer (the
    next step's backward accumulates into them as into any `.grad`, or `zero_grad()` drops them).
    """

    def __init__(self, pipe: GemsPipeline, mine: torch.Tensor, theirs: torch.Tensor):
        self.pipe = pipe
        self.params = _trainable(pipe)
        n_a, n_b = _numel(self.params[0]), _numel(self.params[1])
        self.total = mine[: n_a + n_b]
        self.regions = (mine[:n_a], mine[n_a : n_a + n_b])
        self.local = pipe.partner == pipe.stage
        self.counterparts = (theirs[n_b : n_b + n_a], theirs[:n_b])
        self.works: list = []  # the partner's two messages, received into one-word boxes the works keep
        if not self.local:
            for tag in (TAG_PACKED, TAG_SUMMED):
                box = torch.zeros(1, dtype=torch.int64)
                self.works.append(pipe.comm.recv(box, pipe.partner, tag=tag, async_op=True))

    def _views(self, replica: int) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        offset, region = 0, self.regions[replica]
        for p in self.params[replica]:
            yield p, region[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def start(self, replica: int, share: float) -> None:
        """Replica `replica`'s copy has its step's gradient: weight it by the replica's share of rows, in place."""
        with torch.no_grad():
            for p, view in self._views(replica):
                if p.grad is None:
                    view.zero_()
                elif p.grad.data_ptr() == view.data_ptr() and p.grad.shape == view.shape:
                    view.mul_(share)  # the summed buffer from the last step, zeroed in place and accumulated into
                else:
                    torch.mul(p.grad, share, out=view)

    def _meet(self, index: int, what: str) -> None:
        """Tell the partner that this rank reached point `index` and wait (bounded) until it did too."""
        comm, partner = self.pipe.comm, self.pipe.partner
        comm.fence_shared()
        sent = comm.send(torch.ones(1, dtype=torch.int64), partner, tag=(TAG_PACKED, TAG_SUMMED)[index], async_op=True)
        self.pipe._engines[0].link.wait([sent, self.works[index]], what, partner)
        comm.fence_shared()

    def finish(self) -> None:
        pipe = self.pipe
        if not self.local:
            self._meet(0, "the partner's packed gradients (shared memory)")
        with torch.no_grad():
            for mine, theirs in zip(self.regions, self.counterparts) if not self.local else [self.regions]:
                n = mine.numel()
                lo, hi = (0, n) if self.local else (0, n // 2) if pipe.stage < pipe.partner else (n // 2, n)
                total = torch.add(mine[lo:hi], theirs[lo:hi], out=mine[lo:hi])
                theirs[lo:hi].copy_(total)
        if not self.local:
            self._meet(1, "the partner's halves of the summed gradients (shared memory)")
        dp = pipe.dp
        if dp is not None and dp.size > 1 and self.total.numel():
            dp.allreduce(self.total, "avg")
        for replica in (0, 1):
            for p, view in self._views(replica):
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view


def _halves(value: Any, what: str) -> tuple[Any, Any]:
    """The rows of replica A (the first ceil(B/2)) and of replica B (the rest)."""
    if value is None:
        return None, None
    if microbatch.batch_size(value, what) < 2:
        raise PipelineError(f"schedule='gems' splits the batch between two replicas: {what} needs at least 2 rows")
    first, second = microbatch.split(value, 2, what)
    return first, second


def _trainable(pipe: GemsPipeline) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The parameters with gradients of this rank's copy of replica A's stage, and of replica B's."""
    return (
        [p for p in pipe.layers.parameters() if p.requires_grad],
        [p for p in pipe.mirror_layers.parameters() if p.requires_grad],
    )


def _numel(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def _common_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise PipelineError(f"schedule='gems' needs one dtype per stage's parameters, got {sorted(map(str, dtypes))}")
    return dtypes.pop()


def _flat(tensors: Sequence[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors], out=out)


def _unflat(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _set_grads(flat: torch.Tensor, params: Sequence[nn.Parameter]) -> None:
    offset = 0
    for p in params:
        value = flat[offset : offset + p.numel()].view_as(p)
        if p.grad is None:
            p.grad = value.clone()
        else:
            p.grad.copy_(value)
        offset += p.numel()


SCHEDULE_CLASSES["gems"] = GemsPipeline
