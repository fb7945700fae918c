"""Handles of operations in flight, and the bounded wait that every one of them uses."""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Generic, Optional, Protocol, TypeVar

from hpdl.comm.trace import Tracer
from hpdl.errors import CommTimeoutError

__all__ = ["Work"]

T = TypeVar("T")


class WorkOwner(Protocol):
    """What a handle needs of its communicator: `hpdl.comm.base.Communicator`, which imports this module."""

    @property
    def timeout(self) -> float: ...

    @property
    def tracer(self) -> Optional[Tracer]: ...

    def _timeout_error(self, op: str, seq: int, waited: float) -> CommTimeoutError: ...

    def _check_peers(self, op: str, seq: int) -> None: ...

    def _engine_error(self, op: str, seq: int, exc: Exception) -> Exception: ...

    def _trace_op(self, op: str, started: float) -> None: ...


_NOTHING = object()

# MPI engines move large messages only while a process is inside a call, so a
# waiting rank keeps calling test() at full speed, as a blocking MPI call
# would. Only a wait that lasts longer than SPIN_SECONDS (a straggler, not a
# transfer) backs off to sleeping between tests so as not to burn a core.
SPIN_SECONDS = 1.0
IDLE_SLEEP = 0.001
WATCH_SECONDS = 1.0
"""How often a long wait calls its `watch` (which looks whether the peers can still come)."""
_yield = getattr(os, "sched_yield", lambda: None)


def poll_until(test: Callable[[], bool], deadline: float, watch: Optional[Callable[[], None]] = None) -> bool:
    """Call `test` until it is true (return True) or `deadline` passes (return False).

    Once the wait has lasted SPIN_SECONDS, `watch` (if given) is called every WATCH_SECONDS; it raises to
    end a wait that cannot succeed (a peer that finished without calling this collective).
    """
    if test():
        return True
    spin_end = time.perf_counter() + SPIN_SECONDS
    next_watch = spin_end
    while True:
        # The engine advances a transfer inside each test(): keep the loop bare and
        # read the clock only every 64 tests.
        for _ in range(64):
            if test():
                return True
        now = time.perf_counter()
        if now >= deadline:
            return test()
        if now > spin_end:
            if watch is not None and now >= next_watch:
                watch()
                next_watch = now + WATCH_SECONDS
            time.sleep(IDLE_SLEEP)
        else:
            _yield()  # a peer on the same core needs it to send what this rank waits for


def wait_for(request: Any, deadline: float, timeout: float, what: str, op: str) -> None:
    """Test an MPI `request` until it completes, or raise `CommTimeoutError` saying `what` did not complete
    within `timeout` once `deadline` passed (the start-up collectives' bounded wait: no Work or peers yet)."""
    if not poll_until(request.Test, deadline):
        raise CommTimeoutError(f"{what} did not complete within {timeout:.0f} s (a rank stopped in start-up)", op=op)


_ORPHANS: list[Any] = []
"""Unfinished MPI operations whose handles were dropped (e.g. a step abandoned after a failure). MPI holds
only the buffers' addresses and may still write into them when a peer's message arrives: they are kept
here, alive, until MPI says they are done, so that memory is never reused under a pending transfer."""


class Work(Generic[T]):
    """An operation in flight. `wait()` returns its result, or raises within the timeout.

    `test` says whether the engine has finished; `finish` (optional) turns
    the finished engine buffers into the result (copy back, cast, divide)
    exactly once. Operations in place return the caller's object instead
    (`returns`).
    `block`, when given, waits in the engine itself for at most the given
    seconds and says whether it finished (used where the engine can do so
    without holding the GIL).
    """

    __slots__ = (
        "_comm", "op", "seq", "_test", "_finish", "_block", "_done", "_result", "_returns", "_started", "_keep",
        "source", "_sliced",
    )  # fmt: skip

    def __init__(
        self,
        comm: WorkOwner,
        op: str,
        seq: int,
        test: Callable[[], bool],
        finish: Optional[Callable[[], T]] = None,
        block: Optional[Callable[[float], bool]] = None,
        keep: Any = None,
        sliced: bool = False,
    ):
        self._comm = comm
        self._sliced = sliced
        """`block` may return early (a second at a time) and be called again: the wait watches the peers in
        between. Not for engines whose timed-out wait aborts the communicator (NCCL)."""
        self._keep = keep  # buffers the engine reads or writes until completion (MPI holds only addresses)
        self.op = op
        self.seq = seq
        self._test = test
        self._finish = finish
        self._block = block
        self._done = False
        self._result: Optional[T] = None
        self._returns: Any = _NOTHING
        self._started = time.perf_counter() if comm.tracer is not None else 0.0
        self.source: Optional[int] = None
        """For a receive, once it completed: the rank the message came from (what `recv(t, None)` needs)."""

    def returns(self, value: Any) -> Work:
        """Make `wait()` return `value` (the caller's own object, for operations in place)."""
        self._returns = value
        return self

    def then(self, fn: Callable[[Any], Any]) -> Work:
        """Make `wait()` return `fn(result)`."""
        inner = self._finish
        self._finish = (lambda: fn(inner())) if inner is not None else (lambda: fn(None))
        return self

    def is_completed(self) -> bool:
        """True once the operation finished (does not wait)."""
        if not self._done:
            try:
                finished = self._test()
            except Exception as exc:
                error = self._comm._engine_error(self.op, self.seq, exc)
                if error is exc:
                    raise
                raise error from exc
            if finished:
                self._complete()
        return self._done

    def wait(self, timeout: Optional[float] = None) -> T:
        """Wait for completion and return the result; raise `CommTimeoutError` after `timeout` seconds."""
        try:
            finished = self._done or self._test()  # finished already: the common case for small messages
            if not finished:
                limit = self._comm.timeout if timeout is None else timeout
                deadline = time.perf_counter() + limit
                watch = None if self.seq < 0 else lambda: self._comm._check_peers(self.op, self.seq)
                if self._block is not None:
                    finished = _block_watched(self._block, self._test, deadline, watch if self._sliced else None)
                else:
                    finished = poll_until(self._test, deadline, watch)
                if not finished:
                    raise self._comm._timeout_error(self.op, self.seq, limit)
        except Exception as exc:
            error = self._comm._engine_error(self.op, self.seq, exc)
            if error is exc:
                raise
            raise error from exc
        if not self._done:
            self._complete()
        return self._result  # type: ignore[return-value]

    def __del__(self) -> None:
        if self._done or getattr(self._comm, "backend", None) != "mpi":
            return
        _ORPHANS[:] = [work for work in _ORPHANS if not work._finished_quietly()]
        _ORPHANS.append(self)  # resurrected: the buffers outlive the dropped handle (PEP 442)

    def _finished_quietly(self) -> bool:
        try:
            return self._done or bool(self._test())
        except Exception:  # the engine is gone (MPI finalized): nothing can write any more
            return True

    def _complete(self) -> None:
        result = self._finish() if self._finish is not None else None
        # Let go of the engine's handle and buffers at once: a gloo work object that
        # outlives its process group can abort the process at exit.
        self._keep = self._block = self._finish = None
        self._test = _finished
        self._result = result if self._returns is _NOTHING else self._returns
        self._done = True
        if self._started:
            self._comm._trace_op(self.op, self._started)


def _block_watched(
    block: Callable[[float], bool], test: Callable[[], bool], deadline: float, watch: Optional[Callable[[], None]]
) -> bool:
    """Wait in the engine, a second at a time when there is a `watch` to call in between (gloo's wait
    blocks in C++, where nothing can look whether the peers can still come); in one piece without one."""
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            return bool(test())
        if block(remaining if watch is None else min(remaining, WATCH_SECONDS)):
            return True
        if watch is not None and time.perf_counter() < deadline:
            watch()


def _finished() -> bool:
    return True


def completed(comm: WorkOwner, op: str, seq: int, result: T) -> Work[T]:
    """A handle for work that finished at once (one-process communicators, empty inputs)."""
    return Work(comm, op, seq, lambda: True, lambda: result)


def chain(comm: WorkOwner, op: str, seq: int, parts: list[Work], finish: Callable[[], T]) -> Work[T]:
    """One handle for several engine operations that finish together."""

    def test() -> bool:
        return all(part.is_completed() for part in parts)

    def block(limit: float) -> bool:
        deadline = time.perf_counter() + limit
        for part in parts:
            if part._done:  # finished (and finished off) by an earlier test
                continue
            remaining = max(0.0, deadline - time.perf_counter())
            if part._block is not None:
                if not part._block(remaining):
                    return False
            elif not poll_until(part._test, deadline):
                return False
            part._complete()
        return True

    return Work(comm, op, seq, test, finish, block)
