"""The `Work` torch code receives from the hpdl backend: `wait()`, `is_completed()` and `get_future()`."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist

from hpdl.interop.torch_backend.progress import progress

__all__ = ["HpdlWork"]


class HpdlWork(dist._Work):
    """One operation of the hpdl backend.

    `wait()` drives progress on the calling thread and re-raises the
    operation's own error (a `CommTimeoutError` naming the missing ranks, a
    `CollectiveMismatchError` in debug mode). `get_future()` is what DDP and
    the functional collectives wait on; the progress thread completes it,
    with the list of output tensors as its value.
    """

    # Defaults on the class: an instance sets only what changes (a small dist.all_reduce makes one per call).
    _done = False
    _resolved = False
    _future: Optional[torch.futures.Future] = None  # made on first use: most calls never ask for it
    _error: Optional[BaseException] = None
    _chained = False  # its future has Python callbacks not run yet (set by progress.chained)
    _group: Optional[int] = None  # the communicator it runs on, by id (set by progress when started)
    _timeout = 300.0  # its communicator's (set by progress when started)
    sender: Optional[int] = None

    def __init__(self, outputs: Any = None) -> None:
        super().__init__()
        self._outputs = outputs

    # torch.distributed's Work API ---------------------------------------------------
    def wait(self, timeout: Any = None) -> bool:
        progress.wait(self)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._done:
            progress.poll()
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        with _FUTURES:
            if self._future is None:
                self._future = _WatchedFuture(self)
                if self._resolved:  # finished before anyone asked: no callbacks yet, resolve it here
                    self._resolve(self._future)
            return self._future

    def synchronize(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        """The group rank a receive from any source got its message from (after `wait()`)."""
        if self.sender is None:
            raise RuntimeError("source_rank: only a completed recv from any source (dist.recv without src) has one")
        return self.sender

    _source_rank = source_rank  # what torch.distributed.recv calls

    # completion (from the progress engine) -------------------------------------------
    def _complete(self, result: Any, error: Optional[BaseException]) -> None:
        self._error = error
        if result is not None:
            self._outputs = result
        with _FUTURES:
            future = self._future
            self._resolved = True
        try:
            # The future's callbacks run first: whoever waits for this operation also waits for them.
            if future is not None:
                self._resolve(future)
        finally:
            self._done = True
            if self._chained:
                progress.unchained(self)

    def _resolve(self, future: torch.futures.Future) -> None:
        if self._error is None:
            future.set_result(self._outputs)
        else:
            future.set_exception(self._error)


class _WatchedFuture(torch.futures.Future):
    """A work's future that tells progress when Python code gives it a callback.

    Such a callback may issue collectives (DDP comm hooks, PowerSGD), so later collectives wait until it has
    run; a future with none (DDP's own allreduce, FSDP2's, the functional collectives') holds nothing back.
    Callbacks attached from C++ are not seen; `torch.futures.collect_all`, the one way Python code reaches
    them, is watched (`_watch_collect_all`).
    """

    def __init__(self, work: HpdlWork) -> None:
        super().__init__()
        self._work = weakref.ref(work)  # (not the work itself: it holds this future)

    def _watch(self) -> None:
        work = self._work()
        if work is not None:
            progress.chained(work)

    def then(self, callback: Any) -> Any:
        self._watch()
        return super().then(callback)

    def add_done_callback(self, callback: Any) -> None:
        self._watch()
        super().add_done_callback(callback)

    def wait(self) -> Any:
        """Drives progress on this thread first, as `work.wait()` does: a callback that waits for a later
        operation's future runs on the thread that completes operations (torch's own wait would block it)."""
        work = self._work()
        if work is not None and not work._resolved and not self.done():
            progress.wait(work)
        return super().wait()


def _watch_collect_all() -> None:
    """`torch.futures.collect_all(futures).then(callback)`: the callback runs when the last of the futures
    completes, attached in C++ where `then` is not seen, and it may issue collectives; so the futures of hpdl
    works given to `collect_all` count as having callbacks (a review reproduced the wrong sums otherwise).
    Watched where `torch.futures.collect_all` (and `wait_all`) look it up at every call, `torch._C._collect_all`,
    so that a name imported before hpdl's group was made is watched too."""
    original = torch._C._collect_all
    if getattr(original, "_hpdl_watched", False):
        return

    def collect_all(futures: list) -> Any:
        for future in futures:
            if isinstance(future, _WatchedFuture):
                future._watch()
        return original(futures)

    collect_all._hpdl_watched = True  # type: ignore[attr-defined]
    torch._C._collect_all = collect_all


_watch_collect_all()

_FUTURES = threading.Lock()
"""Guards the lazy creation of a work's future against its completion on another thread."""


def done(outputs: Any) -> HpdlWork:
    """A handle that is already complete."""
    work = HpdlWork(outputs)
    work._complete(outputs, None)
    return work
