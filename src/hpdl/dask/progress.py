"""Drive non-blocking MPI requests in the background, without spinning a core when idle.

MPI offers no file descriptor that an event loop could wait on. The
transport's event loops therefore do the latency-critical MPI calls
themselves (send, and receive when their doorbell rings: see
`hpdl.dask.doorbell`), and this one daemon thread per process does the rest:
it completes requests that need MPI to progress (large frames in flight:
MPICH moves large shared-memory messages only inside MPI calls), runs queued
operations (connect, listen, collectives of the cluster's start) and polls
for what no doorbell announced (a CONNECT from a peer that does not know
this process yet, a lost datagram). Every MPI call of the transport runs
under `lock` (one matched probe and the receives it implies are one step,
whichever thread takes it), so MPI must provide MPI_THREAD_MULTIPLE.

Event loops hand it work through `submit` (a queue plus an event that wakes
it at once) or `kick` (requests started on a loop that need progress) and
get results back with `loop.call_soon_threadsafe`. A watched group is hot
(its requests need this process's MPI calls to finish) or a wait (they finish
without them: a peer's message, a send the receiver reads itself); only hot
groups count as in flight, for every tick takes the GIL from the event loops.
While requests are in flight it polls every `first` seconds for at most `hot`
seconds since the last completion; after its own activity it keeps polling
for `spin`; then it sleeps with exponential back-off (from `first` to `cap`,
HPDL_DASK_POLL_MAX_US, default 1000 us), reset on any activity. Idle, that
is at most one wake-up per millisecond (no core spins), and once the owner
says it will be told of new work (`idle_cap`: the transport's doorbells),
one per the owner's own poll interval.

If the thread itself fails (an MPI error, a bug), nothing may wait for it in
vain: every watched group and every queued operation that was given an
`on_error` gets the failure, then the failure handlers run (the transport's
fails its pending connects and its readers), and later `submit`s raise.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import hpdl.settings as settings

__all__ = ["Backoff", "Progress"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
OnError = Callable[[BaseException], None]
"""Told the failure (as made by `Progress.failure`) when the progress thread dies before the work completes."""


@dataclass(eq=False)
class Group:
    """Requests watched together: `on_done` once all have completed, `on_error` if the thread dies first."""

    requests: list[Any]
    on_done: Callable[[], None]
    keep: Any
    on_error: Optional[OnError]
    hot: bool
    """Whether it needs this process's MPI progress (polled hot) or only waits (tested at the back-off's pace)."""
    key: Any = None
    """What `heat(key)` finds it by (the transport: the peer a send goes to)."""


def _thread_failed(error: BaseException) -> BaseException:
    failure = RuntimeError(f"the mpi:// progress thread has failed: {error!r}")
    failure.__cause__ = error
    return failure


@dataclass
class Backoff:
    """Sleep lengths for a poller: none while busy, then doubling from `first` up to `cap` (seconds)."""

    first: float = 10e-6
    cap: float = 1e-3
    hot: float = 0.05
    """Seconds to keep polling every `first` seconds while requests are in flight and nothing completes."""
    spin: float = 0.0
    """Seconds to keep polling without sleeping after any activity (what follows at once, e.g. a frame's chunks)."""
    delay: float = 0.0
    last_activity: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.cap:
            raise ValueError(f"Backoff: need 0 < first ({self.first}) <= cap ({self.cap})")
        self.last_activity = time.monotonic()

    def activity(self) -> None:
        self.delay = 0.0
        self.last_activity = time.monotonic()

    def next_delay(self, in_flight: bool, cap: float = 0.0) -> float:
        """How long to sleep after an idle poll (back-off up to `cap` seconds, if given, else `self.cap`)."""
        quiet = time.monotonic() - self.last_activity
        if quiet < self.spin:
            return 0.0
        if in_flight and quiet < self.hot:  # short sleeps, not a spin: a spinning thread steals a core of 2
            return self.first
        self.delay = min(cap or self.cap, max(self.first, self.delay * 2))
        return self.delay


def poll_cap() -> float:
    return settings.number("HPDL_DASK_POLL_MAX_US") * 1e-6  # the registry's bounds: 10 to 1000000 us


def _tune_this_thread(name: str) -> None:
    """Let this thread's short sleeps last what they ask (Linux adds up to 50 us of timer slack to each), and give
    it its name in the kernel's view (top -H, perf, /proc/PID/task: what its CPU costs, apart from the loops')."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None).prctl
        prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 ns
        prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME (15 bytes at most)
    except (OSError, AttributeError):  # not Linux: the default slack and name
        pass


class Progress:
    """The progress thread: runs submitted operations, completes request groups, calls the pollers."""

    def __init__(
        self,
        name: str = "hpdl-mpi-progress",
        backoff: Optional[Backoff] = None,
        failure: Callable[[BaseException], BaseException] = _thread_failed,
    ) -> None:
        cap = poll_cap()
        self.backoff = backoff or Backoff(first=min(Backoff.first, cap), cap=cap)
        self.failure = failure
        """Makes the exception that waiters get from the error that ended the thread."""
        self._ops: queue.SimpleQueue[tuple[Callable[[], Any], Optional[OnError]]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._groups: list[Group] = []
        self._pollers: list[Callable[[], bool]] = []
        self._failure_handlers: list[OnError] = []
        self._lock = threading.Lock()
        """Orders `submit` against the failure: an operation is either run or failed, never dropped."""
        self.lock = threading.RLock()
        """Held by every step that calls MPI for the transport or touches the watched groups (any thread)."""
        self.in_flight: Callable[[], bool] = lambda: False
        """Whether the owner has requests in flight besides the watched groups (keeps the thread polling hot)."""
        self.idle_cap: Callable[[], float] = lambda: self.backoff.cap
        """The longest sleep while nothing is in flight, waits included (the owner may know that it is told of new
        work and that its waits are tested elsewhere: every wake-up of this thread takes the GIL from the event
        loops)."""
        self._stopping = False
        self.drain_seconds = 2.0
        """At stop, how long queued operations and in-flight sends may still take."""
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    # ---------------------------------------------------------------- any thread
    def submit(self, op: Callable[[], Any], on_error: Optional[OnError] = None) -> None:
        """Run `op()` on the progress thread soon (in submission order).

        `on_error` is called instead if the thread dies before running `op`;
        once it has died, `submit` raises `failure(error)`."""
        with self._lock:
            if self.error is not None:
                raise self.failure(self.error)
            self._ops.put((op, on_error))
        self._wake.set()

    def call(self, fn: Callable[[], T], timeout: float = 60.0) -> T:
        """Run `fn()` on the progress thread and return its result (blocks the caller, never an event loop)."""
        if threading.current_thread() is self.thread:
            return fn()
        future: Future[T] = Future()

        def op() -> None:
            try:
                future.set_result(fn())
            except BaseException as error:  # noqa: BLE001 - handed back to the caller
                future.set_exception(error)

        self.submit(op, on_error=future.set_exception)
        return future.result(timeout=timeout)

    def kick(self) -> None:
        """Requests were started elsewhere that need MPI to progress: poll hot now (any thread)."""
        self.backoff.activity()
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)

    @property
    def running(self) -> bool:
        return self.thread.is_alive() and not self._stopping

    def watch(
        self,
        requests: list[Any],
        on_done: Callable[[], None],
        keep: Any = None,
        on_error: Optional[OnError] = None,
        hot: bool = True,
        key: Any = None,
    ) -> None:
        """Call `on_done()` (on this thread) once every request of the group has completed (any thread).

        `keep` (the requests' buffers) stays referenced until then: MPI reads and writes them meanwhile.
        `on_error` is called instead if the thread dies first; once it has died, `watch` raises `failure(error)`.
        `hot`: the requests need this process's MPI progress to finish, and this thread polls them every `first`
        seconds while they are in flight. Each such tick takes the GIL from the event loops (hot polling for every
        pending small send made a 64 KiB mpi:// message 1.6x slower), so `hot=False` is for what only waits (a
        peer's message, a barrier, a send that the receiver completes itself): tested at the back-off's pace and
        by whatever thread calls `test_groups`; `heat(key)` makes such groups hot."""
        with self.lock:
            if self.error is not None:
                raise self.failure(self.error)
            self._groups.append(Group(requests, on_done, keep, on_error, hot, key))

    def heat(self, key: Any) -> None:
        """The watched groups of `key` need this process's MPI progress now: poll them hot (any thread)."""
        with self.lock:
            for group in self._groups:
                if group.key == key:
                    group.hot = True
        self.kick()

    # ---------------------------------------------------------------- progress thread only

    def test_groups(self) -> bool:
        """Test every watched group, run `on_done` of those complete; whether any was (any thread: an event loop
        that sends drives MPI's progress of earlier sends too, when this thread waits for the GIL)."""
        with self.lock:
            if not self._groups:
                return False
            from mpi4py import MPI

            testall = MPI.Request.Testall
            pending, busy = [], False
            for group in self._groups:
                if testall(group.requests):
                    busy = busy or group.hot  # a wait that ended is no sign of more MPI work to come
                    group.on_done()
                else:
                    pending.append(group)
            self._groups = pending
            return busy

    def add_poller(self, poll: Callable[[], bool]) -> None:
        """`poll()` runs every tick and says whether it found work."""
        self._pollers.append(poll)

    def add_failure_handler(self, handler: OnError) -> None:
        """`handler(failure)` runs on this thread if it dies (after the watched groups and queued operations)."""
        self._failure_handlers.append(handler)

    def _run(self) -> None:
        _tune_this_thread(self.thread.name)  # mpi4py is imported with the first request (importing it initialises MPI)
        drain_until: Optional[float] = None
        try:
            while True:
                if self._stopping:  # flush first: a CLOSE still queued tells a peer that this side has gone
                    drain_until = drain_until or time.monotonic() + self.drain_seconds
                    if (self._ops.empty() and not self._groups) or time.monotonic() > drain_until:
                        break
                busy = False
                while True:
                    try:
                        op, _ = self._ops.get_nowait()
                    except queue.Empty:
                        break
                    op()
                    busy = True
                for poll in self._pollers:
                    busy = poll() or busy
                if self._groups:
                    busy = self.test_groups() or busy
                if busy:
                    self.backoff.activity()
                    continue
                in_flight = any(group.hot for group in self._groups) or self.in_flight()
                cap = self.backoff.cap if in_flight else self.idle_cap()
                delay = self.backoff.next_delay(in_flight, cap)
                if delay:
                    self._wake.wait(delay)
                    self._wake.clear()
                else:
                    time.sleep(0)  # let the event loops' threads take the GIL
        except BaseException as error:  # noqa: BLE001 - reported to every waiter and every later caller
            logger.exception("mpi:// progress thread failed")
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        """Hand the failure to everything that waits on this thread: nothing may hang on a dead thread."""
        with self._lock:
            self.error = error
            queued = []
            while True:
                try:
                    queued.append(self._ops.get_nowait()[1])
                except queue.Empty:
                    break
        with self.lock:
            groups, self._groups = self._groups, []
        waiters = [group.on_error for group in groups] + queued + self._failure_handlers
        for on_error in waiters:
            if on_error is None:
                continue
            try:
                on_error(self.failure(error))
            except Exception:  # noqa: BLE001 - one broken waiter must not keep the others waiting
                logger.exception("mpi:// progress thread: failing a waiter")
