"""The `Work` torch code receives from the hpdl backend: `wait()`, `is_completed()` and `get_future()`."""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

__all__ = ["HpdlWork"]


class HpdlWork(dist._Work):
    """One operation of the hpdl backend.

    `wait()` drives progress on the calling thread and re-raises the
    operation's own error (a `CommTimeoutError` naming the missing ranks, a
    `CollectiveMismatchError` in debug mode). `get_future()` is what DDP and
    the functional collectives wait on; the progress thread completes it,
    with the list of output tensors as its value.
    """

    def __init__(self, outputs: Any = None) -> None:
        super().__init__()
        from hpdl.interop.torch_backend.progress import progress

        self._progress = progress
        self._event = threading.Event()
        self._future: torch.futures.Future = torch.futures.Future()
        self._outputs = outputs
        self._error: Optional[BaseException] = None

    # torch.distributed's Work API ---------------------------------------------------
    def wait(self, timeout: Any = None) -> bool:
        self._progress.wait(self)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._event.is_set():
            self._progress.poll()
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def result(self) -> Any:
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        return self._future

    def synchronize(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        raise RuntimeError("source_rank: the hpdl backend does not support recv from any source")

    # completion (from the progress engine) -------------------------------------------
    def _complete(self, result: Any, error: Optional[BaseException]) -> None:
        self._error = error
        if result is not None:
            self._outputs = result
        # The future's callbacks run first: whoever waits for this operation also waits for them.
        try:
            if error is None:
                self._future.set_result(self._outputs)
            else:
                self._future.set_exception(error)
        finally:
            self._event.set()


def done(outputs: Any) -> HpdlWork:
    """A handle that is already complete."""
    work = HpdlWork(outputs)
    work._complete(outputs, None)
    return work
