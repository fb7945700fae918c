"""Issue order on the caller's thread, completion on one progress thread.

torch code (DDP's reducer above all) issues a collective and goes on
computing; it expects the backend to finish the operation meanwhile and to
complete the operation's future. MPI moves a message only while someone
calls into it, so:

- every operation is *started* on the thread that issues it, at once, under
  one lock: hpdl posts its non-blocking MPI calls (or runs a shared-memory
  collective) in exactly the order the program issued them;
- one progress thread tests the operations in flight, runs their finishing
  step (copy-backs) and completes their futures;
- a Python `work.wait()` drives progress itself (the same loop), so a
  blocking call pays no thread hand-off.

Every operation keeps the deadline of its communicator's timeout: one that
does not finish in time fails with hpdl's `CommTimeoutError`, naming the
ranks that did not arrive.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from threading import get_ident
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Protocol, TypeVar

from hpdl.comm.base import DECLINED
from hpdl.comm.work import WATCH_SECONDS, poll_until
from hpdl.errors import CommTimeoutError
from hpdl.settings import number

if TYPE_CHECKING:
    from hpdl.comm.base import Communicator


class HpdlWork(Protocol):
    """What progress needs of a handle: `work.HpdlWork`, whose module imports this one."""

    _done: bool
    _chained: bool
    _group: Optional[int]
    _timeout: float

    def _complete(self, result: Any, error: Optional[BaseException]) -> None: ...


Handle = TypeVar("Handle", bound=HpdlWork)


__all__ = ["Progress", "progress", "Started", "Timings", "timings"]

Started = tuple[list, Optional[Callable[[], Any]]]
"""What starting an operation gives: hpdl handles in flight, and the step that turns them into the result."""

TICK_SECONDS = 1e-3
"""An idle progress thread looks for new operations this often..."""
DEEP_SLEEP_AFTER = 0.5
"""...for this long; then it sleeps until an operation is issued."""
GRACE_SECONDS = 200e-6
"""The progress thread leaves a new operation alone this long: a blocking call completes it on its own thread."""
IDLE_SECONDS = 1e-3
"""The progress thread's pause while another thread drives progress in `wait()`."""
ALONE_SECONDS = 10e-3
"""How long `wait()` tests the one operation in flight in a tight loop before it falls back to the general loop."""
QUICK_BYTES = 64 * 1024
"""A collective up to this size, started with nothing else in flight, is tested in a tight loop at once..."""
"""...for `Timings.quick` (the peers' skew, not a transfer): a blocking `dist.all_reduce` of a loss then returns
complete without a pass through the general loop, and one issued with async_op=True loses at most this much."""


class Timings(NamedTuple):
    """The progress thread's tunables, in seconds (read once, at the first group: `timings()`)."""

    spin: float
    """It tests without pausing for this long after an operation starts (latency); longer spins take the core
    from the backward pass that DDP overlaps with communication (one core per rank)..."""
    poll: float
    """...and then pauses this long between tests, so that it leaves the core to the computation it overlaps."""
    quick: float
    """How long a lone collective up to QUICK_BYTES is tested in a tight loop at once."""


@functools.cache
def timings() -> Timings:
    """HPDL_TORCH_SPIN_US, _POLL_US and _QUICK_US through the settings registry, on first use (the factory asks
    when it makes a group, so a bad value is an error of `init_process_group` that names the variable, never
    one of `import`)."""
    spin, poll, quick = (number(name) for name in ("HPDL_TORCH_SPIN_US", "HPDL_TORCH_POLL_US", "HPDL_TORCH_QUICK_US"))
    return Timings(spin * 1e-6, poll * 1e-6, quick * 1e-6)


_yield = getattr(os, "sched_yield", lambda: None)


class _Pending:
    __slots__ = ("parts", "finish", "handle", "comm", "started", "deadline", "p2p", "next_watch")

    def __init__(
        self, parts: list, finish: Optional[Callable[[], Any]], handle: HpdlWork, comm: Communicator, p2p: bool
    ):
        self.p2p = p2p
        self.parts = parts
        self.finish = finish
        self.handle = handle
        self.comm = comm
        self.started = time.perf_counter()
        self.deadline = self.started + comm.timeout
        self.next_watch = self.started + WATCH_SECONDS  # a wait of a second: a straggler, not a transfer

    def test(self, now: float) -> tuple[bool, Any, Optional[BaseException]]:
        """(finished, result, error): parts are tested in order; past the deadline the first unfinished one fails.

        A collective that has waited a second looks at the peers once a second, as `Work.wait` does: a
        peer that finished without calling it fails it at once (`CollectiveMismatchError`).
        """
        try:
            for i, part in enumerate(self.parts):
                if not part.is_completed():
                    if now < self.deadline:
                        del self.parts[:i]
                        if now >= self.next_watch and part.seq >= 0:
                            self.next_watch = now + WATCH_SECONDS
                            self.comm._check_peers(part.op, part.seq)
                        return False, None, None
                    if not part.is_completed():  # (a last look) hpdl's CommTimeoutError, naming the missing ranks
                        raise self.comm._timeout_error(part.op, part.seq, now - self.started)
                    part.wait()
            return True, (self.finish() if self.finish is not None else None), None
        except BaseException as exc:  # every failure goes to the waiting side
            return True, None, exc


class Progress:
    """Operations in flight for every hpdl process group of this process, and the thread that completes them."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._inflight: list[_Pending] = []
        self._waiters = 0
        self._callback_threads: set[int] = set()
        """Threads running futures' callbacks now (set.add/discard/in are atomic: no lock per delivery)."""
        self._batches: dict[int, list[list[list]]] = {}
        """Per thread, the batches of finished operations it is delivering (`deliver_mine`)."""
        self._thread: Optional[threading.Thread] = None
        self._last_collective: dict[int, HpdlWork] = {}
        """Per communicator (by id): the blocking fast path (`submit_one`) is taken only when it is done."""
        self._chained: dict[int, dict[int, HpdlWork]] = {}
        """Per communicator (by id): its operations (by id) whose futures have Python callbacks not run yet (see
        `submit`). MPI matches collectives per communicator, so only their order within a group must be the same
        on every rank; two groups' collectives may interleave differently on different ranks."""
        self._deep_sleep = True

    @property
    def lock(self) -> threading.Condition:
        """Held while hpdl's communicators are used (start, test): one thread at a time talks to MPI."""
        return self._cond

    def submit(self, comm: Communicator, start: Callable[[], Started], handle: Handle, p2p: bool = False) -> Handle:
        """Start an operation now (errors in its arguments raise here) and complete `handle` when it finishes.

        A collective starts only once every earlier one of its group whose future has Python callbacks
        (`then`, `add_done_callback`) has completed *and* run them: a callback may issue collectives of its own
        (DDP comm hooks, PowerSGD), and they must take the same place in the sequence on every rank. Any other
        collective starts at once, with earlier ones still in flight: DDP's reducer (no callbacks) issues
        the next bucket while the last one is in flight and goes on with the backward pass. Point-to-point
        operations are never held back (both peers may send before they receive).
        """
        in_callback = get_ident() in self._callback_threads
        if not p2p and not in_callback and self._chained.get(id(comm)):
            self._wait_for_callbacks(comm)
        with self._cond:
            parts, finish = start()
            pending = _Pending(parts, finish, handle, comm, p2p)
            handle._timeout = comm.timeout
            if not p2p:  # (a send's or receive's callbacks hold nothing back)
                self._last_collective[id(comm)] = handle
                handle._group = id(comm)
            if not self._inflight:  # nothing earlier to finish first: small messages often complete here
                done, result, error = pending.test(time.perf_counter())
                if done:
                    pending = None  # type: ignore[assignment]
            if pending is not None:
                self._track(pending)
        if pending is None:
            handle._complete(result, error)
        elif in_callback:
            # Issued from a future's callback: the callback may block on it in C++ (PowerSGD's hook does),
            # where nobody could complete it, since this thread is the one that completes futures. Finish it here.
            self.wait(handle)
        return handle

    def submit_one(
        self,
        comm: Communicator,
        begin: Callable[[], Any],
        handle: Handle,
        nbytes: int,
        *,
        blocking: bool = False,
        briefly: Optional[Callable[[], Any]] = None,
    ) -> Handle:
        """`submit` for one hpdl operation with no finishing step (a single contiguous tensor in place): the small
        collectives of torch code (a loss, a metric, a flag, DTensor's) with a quarter of the bookkeeping.

        Taken only when nothing is in flight, no future's callback runs and none is pending; otherwise, and for
        the ordering rules that then apply, it is `submit`. After the start it is tested in a tight loop under
        the lock: up to 64 KiB for QUICK_SPIN_SECONDS, and for up to ALONE_SECONDS (the bound `wait()` holds the
        lock for anyway) when `blocking` (torch said `asyncOp=False`: the caller waits at once), so that a blocking
        call that finishes in that time needs no pass through the progress machinery (a 64 KiB
        `dist.all_reduce` took 2x the direct call through it). Never longer: another thread of the process
        may have to issue the operation a peer needs before that peer can join this one. `briefly` (a blocking
        caller's): the communicator's `start_briefly` for the same call, which does that wait in the engine's own
        call (compiled: without a `Work` and a Python loop of tests; a 4-byte `dist.all_reduce` 20-23 -> 17-18 us).
        """
        general = done = False
        error: Optional[BaseException] = None
        with self._cond:
            previous = self._last_collective.get(id(comm))
            if (
                self._inflight
                or self._callback_threads
                or (previous is not None and not previous._done)
                or self._chained.get(id(comm))
            ):
                general = True
            else:
                started = briefly() if blocking and briefly is not None else DECLINED
                work: Any = begin() if started is DECLINED else started  # argument errors raise here, as in submit
                self._last_collective[id(comm)] = handle
                handle._group = id(comm)
                handle._timeout = comm.timeout
                try:
                    seconds = ALONE_SECONDS if blocking else timings().quick if nbytes <= QUICK_BYTES else 0.0
                    done = (
                        work is None
                        or work.is_completed()
                        or (seconds > 0 and poll_until(work.is_completed, time.perf_counter() + seconds))
                    )
                except BaseException as exc:  # the operation's own failure goes to the waiting side
                    done, error = True, exc
                if not done:
                    self._track(_Pending([work], None, handle, comm, False))
        if general:
            return self.submit(comm, lambda: ([begin()], None), handle)
        if done:
            handle._complete(None, error)
        return handle

    def _track(self, pending: _Pending) -> None:
        """Hand an operation still in flight to the progress thread (under the lock)."""
        self._inflight.append(pending)
        self._ensure_thread()
        if self._deep_sleep:
            self._cond.notify()

    def chained(self, handle: HpdlWork) -> None:
        """`handle`'s future got a Python callback: collectives issued from now on wait until it has run."""
        with self._cond:
            if not handle._done and handle._group is not None:
                handle._chained = True
                self._chained.setdefault(handle._group, {})[id(handle)] = handle

    def unchained(self, handle: HpdlWork) -> None:
        """`handle` is complete and its future's callbacks have run."""
        with self._cond:
            if handle._group is not None:
                self._chained.get(handle._group, {}).pop(id(handle), None)

    def _wait_for_callbacks(self, comm: Communicator) -> None:
        """Until every operation of the group whose future has Python callbacks is complete and has run them.

        A callback chain (PowerSGD: allreduce, then P, then Q) issues its next collective only after the one
        before it has completed, and that collective must come before this one on every rank: on a rank where
        the chained operation was already complete, `then` ran the callback at once, before this call."""
        deadline = time.monotonic() + comm.timeout
        while True:
            with self._cond:
                chained = self._chained.get(id(comm), {})
                waiting = [handle for handle in chained.values() if not handle._done]
                if not waiting:
                    chained.clear()
                    return
            for handle in waiting:
                self.wait(handle)
            if time.monotonic() > deadline:
                raise CommTimeoutError(
                    f"a torch future's callback (a DDP comm hook?) has run for over {comm.timeout:g} s; the next "
                    "collective waits for it so that every rank issues collectives in the same order"
                )

    def forget(self, comm: Communicator) -> None:
        """Drop a closed group's last collective (it holds that call's tensors)."""
        self._last_collective.pop(id(comm), None)
        self._chained.pop(id(comm), None)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` (which uses a communicator) under the lock, between operations."""
        with self._cond:
            return fn()

    def wait(self, handle: HpdlWork) -> None:
        """Drive progress on this thread until `handle` is complete (bounded by the operation's deadline)."""
        if handle._done:
            return
        with self._cond:
            self._waiters += 1
        try:
            self._drive_alone(handle)
            delivered_by_another: Optional[float] = None
            while not handle._done:
                finished = self._poll()
                self._deliver(finished)
                if not finished and not handle._done and not self._has(handle):
                    if self.deliver_mine(handle):
                        continue
                    if self._delivering_here(handle):
                        return  # a callback of its own future waits for it: its result is there
                    # Another thread holds its result and runs its future's callbacks: bounded too.
                    now = time.monotonic()
                    if delivered_by_another is None:
                        delivered_by_another = now
                    elif now - delivered_by_another > handle._timeout:
                        raise CommTimeoutError(
                            f"a torch future's callback (a DDP comm hook?) has run for over {handle._timeout:g} s "
                            "on another thread; whoever waits for the operation waits for its callbacks"
                        )
                    time.sleep(timings().poll)
        finally:
            with self._cond:
                self._waiters -= 1

    def _drive_alone(self, handle: HpdlWork) -> None:
        """The blocking call's case: `handle`'s operation is the only one in flight. Test it in a tight loop
        under the lock for up to ALONE_SECONDS, as a blocking MPI call spins: a pass of the general loop costs
        microseconds of Python between two tests, and the engine moves a message only inside a test (a 1 MiB
        allreduce took 245 us through that loop against 178 us called directly)."""
        with self._cond:
            if len(self._inflight) != 1 or self._inflight[0].handle is not handle:
                return
            pending, outcome = self._inflight[0], []

            def test() -> bool:
                done, result, error = pending.test(0.0)  # 0: before any deadline or watch (the general loop's)
                if done:
                    outcome.append((handle, result, error))
                return done

            if not poll_until(test, time.perf_counter() + ALONE_SECONDS):
                return
            self._inflight.clear()
        self._deliver(outcome)

    def poll(self) -> None:
        """Test the operations in flight once (for `is_completed`)."""
        self._deliver(self._poll())

    def _has(self, handle: HpdlWork) -> bool:
        with self._cond:
            return any(p.handle is handle for p in self._inflight)

    def _poll(self) -> list:
        with self._cond:
            if not self._inflight:
                return []
            now = time.perf_counter()
            finished, remaining = [], []
            for pending in self._inflight:
                done, result, error = pending.test(now)
                if done:
                    finished.append((pending.handle, result, error))
                else:
                    remaining.append(pending)
            self._inflight = remaining
            return finished

    def _deliver(self, finished: list) -> None:
        # Outside the lock: a future's callbacks (DDP comm hooks, PowerSGD) may issue the next operation.
        if not finished:
            return
        me = get_ident()
        nested = me in self._callback_threads
        self._callback_threads.add(me)
        batch = [[handle, result, error, False] for handle, result, error in finished]
        batches = self._batches.setdefault(me, [])
        batches.append(batch)
        try:
            for entry in batch:
                if not entry[3]:  # (a callback of an earlier one may have delivered it: deliver_mine)
                    entry[3] = True
                    entry[0]._complete(entry[1], entry[2])
        finally:
            batches.pop()
            if not nested:
                self._callback_threads.discard(me)

    def _delivering_here(self, handle: HpdlWork) -> bool:
        """Whether this thread is running `handle`'s future's callbacks now."""
        return any(entry[0] is handle and entry[3] for batch in self._batches.get(get_ident(), ()) for entry in batch)

    def deliver_mine(self, handle: HpdlWork) -> bool:
        """Deliver `handle` now if it finished in a batch this thread is delivering: a callback of an earlier
        operation of the batch waits for it (on this thread, which alone could deliver it). Issue order is
        kept otherwise: every other operation is delivered in the order it finished."""
        for batch in self._batches.get(get_ident(), ()):
            for entry in batch:
                if entry[0] is handle and not entry[3]:
                    entry[3] = True
                    handle._complete(entry[1], entry[2])
                    return True
        return False

    def _ensure_thread(self) -> None:
        if self._thread is None:  # (cleared by the thread if it ever ends: is_alive() costs a lock per call)
            self._thread = threading.Thread(target=self._run, name="hpdl-torch-progress", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self._thread = None

    def _serve(self) -> None:
        others = OtherThreads()
        while True:
            with self._cond:
                idle_since = time.perf_counter()
                while not self._inflight:
                    # Idle: look again every tick (so that issuing an operation needs no wake-up call),
                    # and after a while sleep until `submit` wakes this thread.
                    self._deep_sleep = time.perf_counter() - idle_since > DEEP_SLEEP_AFTER
                    self._cond.wait(None if self._deep_sleep else TICK_SECONDS)
                self._deep_sleep = False
                oldest, newest = self._inflight[0].started, self._inflight[-1].started
            now = time.perf_counter()
            if self._waiters:
                # A thread waits in wait() and drives progress itself: stay out of its way (every
                # hand-off of the GIL or the lock between threads costs a scheduler wake-up).
                time.sleep(IDLE_SECONDS)
                continue
            if now - newest < GRACE_SECONDS:  # give the issuing thread the chance to wait for it itself
                time.sleep(GRACE_SECONDS)
                continue
            self._deliver(self._poll())
            if now - oldest <= timings().spin:
                time.sleep(0)
            elif others.busy():
                time.sleep(timings().poll)
            else:
                _yield()


class OtherThreads:
    """Whether the process's other threads used the CPU since the last look (from the process's and this
    thread's CPU clocks, exact on Linux).

    Past its spin the progress thread pauses between tests while the rest of the process computes (DDP's
    backward, on the same core), and tests without pausing while it only waits (DDP's reducer blocked on the
    futures in C++, where nothing but this thread moves the messages).
    """

    BUSY = 0.5
    """Share of the wall time the other threads must have used to count as computing."""

    def __init__(self) -> None:
        self._wall, self._process, self._thread = time.perf_counter(), time.process_time(), time.thread_time()

    def busy(self) -> bool:
        wall, process, thread = time.perf_counter(), time.process_time(), time.thread_time()
        used = (process - self._process) - (thread - self._thread)
        busy = used > self.BUSY * (wall - self._wall)
        self._wall, self._process, self._thread = wall, process, thread
        return busy


progress = Progress()
"""The one instance: operations of every hpdl group complete in one place, in issue order per group."""
