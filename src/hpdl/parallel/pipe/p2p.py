"""Activations and gradients between neighbouring stages, and the control channel that carries failures.

Fast path: the shapes and dtypes of what crosses each stage boundary are
sent once per input shape (a small fixed-size int64 "meta" message per
micro-batch), then only raw tensors travel, into buffers taken from a pool
and posted early (`comm.recv(..., async_op=True)`), so a transfer overlaps
the compute before it. Nothing on this path is pickled.

Control: at the start of a step each stage posts one small receive from
each neighbour. At the end of the step each stage sends "ok" (carrying the
mean loss, relayed from the last stage towards the first) to its
neighbours. A stage that fails sends "error" instead, followed by its
pickled exception text and traceback; a stage that learns of an error while
waiting for anything raises `StageFailedError` with that traceback and
passes the error on to its other neighbour, so every stage stops. Every
wait is bounded by the communicator's timeout.
"""

from __future__ import annotations

import math
import pickle
import threading
import time
import traceback
from typing import Callable, Optional, Sequence

import torch

from hpdl.comm.base import Communicator
from hpdl.comm.work import Work, poll_until
from hpdl.errors import CommTimeoutError
from hpdl.parallel.pipe.errors import PipelineError, StageFailedError

__all__ = ["Spec", "spec_of", "describe", "Link", "FAILURE_NOTICE_SECONDS"]

Spec = tuple[tuple[tuple[int, ...], torch.dtype], ...]
"""(shape, dtype) of each tensor of one message."""
Sent = tuple[torch.Tensor, Work]
"""A tensor in flight and the handle of its send."""

TAG_HEADER, TAG_META, TAG_CONTROL, TAG_ERROR = 1, 2, 3, 4
TAG_ACTIVATION, TAG_GRADIENT = 100, 200
"""Activation / gradient tensor i of a message travels with tag base + i."""
MAX_TENSORS = 64
META_WORDS = 256
HEADER_WORDS = 6
OK, ERROR = 0.0, 1.0
WATCH_SECONDS = 0.002
"""On gloo, how often a waiting stage looks for a neighbour's failure notice."""
FAILURE_NOTICE_SECONDS = 10.0
"""How long a failing stage waits for its error notices to leave."""

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip
_CODES = {dtype: i for i, dtype in enumerate(_DTYPES)}


def spec_of(tensors: Sequence[torch.Tensor]) -> Spec:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


def describe(spec: Spec) -> str:
    return ", ".join(f"{list(shape)} {str(dtype).replace('torch.', '')}" for shape, dtype in spec)


def encode(spec: Spec) -> torch.Tensor:
    words = [len(spec)]
    for shape, dtype in spec:
        if dtype not in _CODES:
            raise PipelineError(f"a stage output of dtype {dtype} cannot cross stages; use one of {_DTYPES}")
        words += [_CODES[dtype], len(shape), *shape]
    if len(spec) > MAX_TENSORS or len(words) > META_WORDS:
        raise PipelineError(
            f"a stage output of {len(spec)} tensors ({describe(spec)}) is too large a description to send; "
            f"pass at most {MAX_TENSORS} tensors of few dimensions between stages"
        )
    out = torch.zeros(META_WORDS, dtype=torch.int64)
    out[: len(words)] = torch.tensor(words, dtype=torch.int64)
    return out


def decode(words: torch.Tensor) -> Spec:
    values = words.tolist()
    count, i, spec = values[0], 1, []
    for _ in range(count):
        code, ndim = values[i], values[i + 1]
        spec.append((tuple(values[i + 2 : i + 2 + ndim]), _DTYPES[code]))
        i += 2 + ndim
    return tuple(spec)


def gradient_spec(spec: Spec) -> Spec:
    """Gradients travel back for the floating-point tensors of a message (in order)."""
    return tuple((shape, dtype) for shape, dtype in spec if dtype.is_floating_point or dtype.is_complex)


class Link:
    """This stage's channels to its neighbours over a private communicator (rank = stage).

    `replica` and `ranks` are for messages: what follows "stage s" in them (GEMS: " of replica B") and the rank of
    the pipeline's communicator that runs each stage (default: stage s on rank s).
    """

    def __init__(
        self, comm: Communicator, stage: int, stages: int, *, replica: str = "", ranks: Optional[Sequence[int]] = None
    ):
        self.comm = comm
        self.replica = replica
        self.ranks = list(ranks) if ranks is not None else list(range(stages))
        self.stage = stage
        self.stages = stages
        self.prev: Optional[int] = stage - 1 if stage > 0 else None
        self.next: Optional[int] = stage + 1 if stage < stages - 1 else None
        self._pool: dict[Spec, list[tuple[torch.Tensor, ...]]] = {}
        self._sends: list[Work] = []
        self._held: list[tuple[Spec, tuple[torch.Tensor, ...], list[Work]]] = []
        self._control: dict[int, tuple[torch.Tensor, Work]] = {}
        self.broken = False
        self.wait_seconds = 0.0
        # MPI requests can be tested; a gloo point-to-point handle completes only inside a wait, and a wait
        # that times out closes the connection: there, waits block in helper threads (`_Waiter`).
        self.polling = comm.backend != "torch"
        self._watchers: dict[int, _Waiter] = {}

    def failure(self, error: BaseException) -> StageFailedError:
        """This stage's own failure as its neighbours hear of it (`fail` sends it; GEMS sends it on both links)."""
        text = f"{self.name(self.stage)} failed: {type(error).__name__}: {error}"
        tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return StageFailedError(text, stage=self.stage, remote_traceback=tb, detail=text)

    def name(self, stage: int) -> str:
        """How messages name `stage`: "stage 2 (rank 2)", or in GEMS "stage 2 of replica B (rank 1)"."""
        return f"stage {stage}{self.replica} (rank {self.ranks[stage]})"

    # ------------------------------------------------------------------ step life cycle
    def begin(self) -> None:
        """Post this step's control receives (one from each neighbour)."""
        if self.broken:
            raise PipelineError(
                "this pipeline stopped after a failure (see the first error); build a new Pipeline to go on"
            )
        self.wait_seconds = 0.0
        for peer in (self.prev, self.next):
            if peer is not None:
                box = torch.zeros(3, dtype=torch.float64)
                self._control[peer] = (box, self.comm.recv(box, peer, tag=TAG_CONTROL, async_op=True))
                if not self.polling:
                    self._watchers[peer] = _Waiter([self._control[peer][1]])

    def finish(self, loss: float) -> float:
        """End the step: agree that no stage failed and hand the last stage's loss to every stage."""
        if self.next is not None:
            loss = self._control_result(self.next)
        for peer in (self.prev, self.next):
            if peer is not None:
                self._sends.append(
                    self.comm.send(
                        torch.tensor([OK, loss, 0.0], dtype=torch.float64), peer, tag=TAG_CONTROL, async_op=True
                    )
                )
        if self.prev is not None:
            self._control_result(self.prev)
        self.drain()
        self._control.clear()
        return loss

    def fail(self, error: BaseException) -> None:
        """Tell the neighbours (except the one the error came from) that the step failed; never raises."""
        self.broken = True
        if not isinstance(error, StageFailedError):
            error = self.failure(error)
        origin, text, tb = error.stage, error.detail, error.remote_traceback
        skip = getattr(error, "_via", None) if getattr(error, "_link", self) is self else None
        payload = torch.frombuffer(bytearray(pickle.dumps((origin, text, tb))), dtype=torch.uint8)
        works = []
        for peer in (self.prev, self.next):
            if peer is None or peer == skip:
                continue
            try:
                notice = torch.tensor([ERROR, math.nan, float(payload.numel())], dtype=torch.float64)
                works.append(self.comm.send(notice, peer, tag=TAG_CONTROL, async_op=True))
                works.append(self.comm.send(payload, peer, tag=TAG_ERROR, async_op=True))
            except Exception:  # the neighbour may be gone; its own error is then the one that counts
                pass
        # One bound for all of them, no longer than any other wait: a neighbour that left the step never takes
        # a notice too large to go out eagerly (Open MPI's shared-memory limit is 4 KB; a traceback is more).
        deadline = time.perf_counter() + min(FAILURE_NOTICE_SECONDS, self.comm.timeout)
        for work in works:
            try:
                work.wait(timeout=max(0.0, deadline - time.perf_counter()))
            except Exception:
                pass

    # ------------------------------------------------------------------ messages
    def send_header(self, words: list[int]) -> None:
        if self.next is not None:
            self._sends.append(self.comm.send(torch.tensor(words, dtype=torch.int64), self.next, tag=TAG_HEADER,
                                              async_op=True))  # fmt: skip

    def recv_header(self) -> list[int]:
        box = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        assert self.prev is not None
        self.wait([self.comm.recv(box, self.prev, tag=TAG_HEADER, async_op=True)], "the step header", self.prev)
        return box.tolist()

    def send_meta(self, spec: Spec) -> None:
        assert self.next is not None
        self._sends.append(self.comm.send(encode(spec), self.next, tag=TAG_META, async_op=True))

    def recv_meta(self) -> Spec:
        assert self.prev is not None
        box = torch.zeros(META_WORDS, dtype=torch.int64)
        self.wait([self.comm.recv(box, self.prev, tag=TAG_META, async_op=True)], "shapes", self.prev)
        return decode(box)

    def send(self, tensors: Sequence[torch.Tensor], peer: int, base_tag: int) -> list[Sent]:
        """Start sending each tensor (contiguous, kept alive by the handle) to `peer`; returns (tensor, handle)s."""
        works = [self.comm.send(t, peer, tag=base_tag + i, async_op=True) for i, t in enumerate(tensors)]
        self._sends.extend(works)
        return list(zip(tensors, works))

    def post(self, spec: Spec, peer: int, base_tag: int) -> tuple[tuple[torch.Tensor, ...], list[Work]]:
        """Post receives for one message of `spec` from `peer` into pooled buffers; wait on the handles later."""
        free = self._pool.get(spec)
        buffers = free.pop() if free else tuple(torch.empty(shape, dtype=dtype) for shape, dtype in spec)
        works = [self.comm.recv(b, peer, tag=base_tag + i, async_op=True) for i, b in enumerate(buffers)]
        return buffers, works

    def release(self, spec: Spec, buffers: tuple[torch.Tensor, ...], sent: Sequence[Sent] = ()) -> None:
        """Give receive buffers back to the pool; a buffer that a send in flight reads from waits for that send.

        Only a send of the buffer's own memory (a stage that passes its input
        through) can alias it; every other send reads other memory, so the
        buffer is free at once (on gloo a send completes only inside a wait).
        """
        after = [work for tensor, work in sent if _overlaps(tensor, buffers)]
        if all(w.is_completed() for w in after):
            self._pool.setdefault(spec, []).append(buffers)
        else:
            self._held.append((spec, buffers, after))

    def progress(self) -> None:
        """Let MPI move messages in flight (one test drives the whole progress engine); called between layers.

        A large message goes through MPI's rendezvous protocol, which advances
        only while a process is inside an MPI call: without these tests a stage
        that sends and then computes would hold its neighbour idle until its
        next wait.
        """
        for work in reversed(self._sends):
            if not work.is_completed():
                return

    def reap(self) -> None:
        """Return held buffers whose sends have finished (cheap; called between actions)."""
        if self._held:
            still = []
            for spec, buffers, after in self._held:
                if all(w.is_completed() for w in after):
                    self._pool.setdefault(spec, []).append(buffers)
                else:
                    still.append((spec, buffers, after))
            self._held = still
        if len(self._sends) > 64:
            self._sends = [w for w in self._sends if not w.is_completed()]

    def drain(self) -> None:
        """Wait for every send of this step."""
        pending, self._sends = self._sends, []
        self.wait(pending, "sends to finish", None)
        self.reap()

    # ------------------------------------------------------------------ waiting
    def wait(self, works: list[Work], what: str, peer: Optional[int]) -> None:
        """Wait for `works`, bounded by the timeout, raising at once if a neighbour reports a failure."""
        if not works:
            return
        if self.polling:
            if all(w.is_completed() for w in works):
                return
            self._await(lambda: all(w.is_completed() for w in works), None, what, peer)
        else:
            waiter = _Waiter(works)
            self._await(waiter.is_set, waiter, what, peer)
            waiter.check()

    def _await(self, done: Callable[[], bool], waiter: Optional[_Waiter], what: str, peer: Optional[int]) -> None:
        started = time.perf_counter()
        deadline = started + self.comm.timeout
        controls = list(self._control)

        def test() -> bool:
            for p in controls:
                if self._arrived(p) and self._control[p][0][0].item() == ERROR:
                    return True
            return done()

        if waiter is None:
            finished = poll_until(test, deadline)
        else:  # gloo: the wait blocks in a thread; this one watches it and the neighbours' notices
            while not (finished := test()) and time.perf_counter() < deadline:
                waiter.wait(WATCH_SECONDS)
        self.wait_seconds += time.perf_counter() - started
        for p in controls:
            self._check_control(p)
        if not finished:
            self.broken = True
            source = f" from {self.name(peer)}" if peer is not None else ""
            raise CommTimeoutError(
                f"{self.name(self.stage)} waited {self.comm.timeout:.1f} s for {what}{source} and gave up: that "
                "stage is stuck or was not running the same pipeline step (every rank of the pipeline must call step() "
                "or predict() together). Raise the limit with hpdl.init(timeout=...) if a stage is only slow.",
                op=f"pipeline {what}",
                missing=(self.ranks[peer],) if peer is not None else (),
            )

    def _arrived(self, peer: int) -> bool:
        """Whether the control message from `peer` has arrived (without waiting)."""
        if self.polling:
            return self._control[peer][1].is_completed()
        waiter = self._watchers[peer]
        if waiter.is_set():
            waiter.check()
            return True
        return False

    def _check_control(self, peer: int) -> None:
        box = self._control[peer][0]
        if not self._arrived(peer) or box[0].item() != ERROR:
            return
        self.broken = True
        payload = torch.empty(int(box[2].item()), dtype=torch.uint8)
        detail = f"{self.name(peer)} reported a failure, and its details did not arrive"
        origin, tb = peer, ""
        try:
            self.comm.recv(payload, peer, tag=TAG_ERROR, async_op=True).wait(timeout=FAILURE_NOTICE_SECONDS)
            origin, detail, tb = pickle.loads(payload.numpy().tobytes())
        except Exception:
            pass
        error = StageFailedError(
            f"{detail}\n({self.name(self.stage)} stopped because of it.) Original traceback:\n{tb}",
            stage=origin,
            remote_traceback=tb,
            detail=detail,
        )
        error._via = peer  # type: ignore[attr-defined]  # do not send it back where it came from...
        error._link = self  # type: ignore[attr-defined]  # ...on this link (GEMS relays it on its other one too)
        raise error

    def _control_result(self, peer: int) -> float:
        box, work = self._control[peer]
        if self.polling:
            self.wait([work], "the end of the step", peer)
        else:
            self._await(self._watchers[peer].is_set, self._watchers[peer], "the end of the step", peer)
        self._check_control(peer)
        return float(box[1].item())

    def close(self) -> None:
        self._pool.clear()
        self._sends.clear()


def _overlaps(tensor: torch.Tensor, buffers: tuple[torch.Tensor, ...]) -> bool:
    ptr = tensor.untyped_storage().data_ptr()
    return any(b.untyped_storage().data_ptr() == ptr for b in buffers)


class _Waiter(threading.Event):
    """Waits for handles in a daemon thread (each wait bounded by the communicator's timeout); set when done."""

    def __init__(self, works: list[Work]):
        super().__init__()
        self.error: Optional[BaseException] = None
        threading.Thread(target=self._run, args=(works,), daemon=True).start()

    def _run(self, works: list[Work]) -> None:
        try:
            for work in works:
                work.wait()
        except BaseException as error:  # handed to the waiting stage by check()
            self.error = error
        self.set()

    def check(self) -> None:
        if self.error is not None:
            raise self.error
