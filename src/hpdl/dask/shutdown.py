"""How a Dask cluster on MPI ranks ends without errors: the workers leave first, then the scheduler closes.

Left to itself, `Scheduler.close()` sends every worker "close" and
"close-stream" on the worker's stream and closes that stream at once. The
worker, handling "close", still writes on it ("closing-worker", its status
change, its own "close-stream"), meets the stream its peer has closed, and
distributed logs `CommClosedError: ... write on a closed comm` with a
traceback ("Batched Comm Closed"): on tcp:// in every run of `hpdl dask`
(10 of 10 measured), on mpi:// in some (2 of 10), whenever the worker's write
comes after the scheduler's close. `WorkersLeaveFirst` (a scheduler plugin)
runs before that: it asks each worker to close while the scheduler keeps
serving; the worker sends its last messages and closes its own stream, the
scheduler reads them and removes it. Only then does the scheduler close, with no worker attached.
This holds however the shutdown comes (`hpdl dask`'s client, `initialize`'s
exit, a client outside the job calling `client.shutdown()`).

`Worker` is distributed's Worker, except that its close first stops its
heartbeat and waits for one still in flight: the close shuts the worker's connections, and a
heartbeat cut off that way is logged as an ERROR with a traceback ("Failed to
communicate with scheduler during heartbeat"). Its class name stays `Worker`:
distributed derives the scratch directory's prefix and the config key of the
blocked handlers (`distributed.worker.blocked-handlers`) from it.

This module imports distributed: `hpdl.dask.cluster` imports it where a
scheduler or a worker starts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

import distributed
from distributed.diagnostics.plugin import SchedulerPlugin

__all__ = ["Worker", "WorkersLeaveFirst", "stop_heartbeat"]

logger = logging.getLogger(__name__)
HEARTBEAT_WAIT = 10.0
"""Seconds a closing worker waits for a heartbeat in flight (one round trip to a live scheduler)."""


class WorkersLeaveFirst(SchedulerPlugin):  # type: ignore[misc]
    """Before the scheduler closes: every worker closes itself and leaves (bounded by `timeout` seconds)."""

    name = "hpdl-workers-leave-first"

    def __init__(self, scheduler: Any, timeout: float) -> None:
        self.scheduler = scheduler
        self.timeout = timeout

    async def before_close(self) -> None:
        scheduler = self.scheduler
        for address in list(scheduler.workers):
            scheduler.close_worker(address)  # "close" on the worker's stream, which stays open
        deadline = time.monotonic() + self.timeout
        while scheduler.workers and time.monotonic() < deadline:  # each is removed once its stream has ended
            await asyncio.sleep(0.01)
        if scheduler.workers:  # the scheduler's own close ends them (with distributed's log lines)
            logger.warning(
                "hpdl.dask: workers still attached %g s after they were asked to close: %s",
                self.timeout,
                ", ".join(sorted(scheduler.workers)),
            )


class Worker(distributed.Worker):  # type: ignore[misc]
    """distributed's Worker, whose close first stops its heartbeat and lets one in flight finish."""

    _hpdl_heartbeat: Optional[asyncio.Task[Any]] = None

    async def heartbeat(self) -> None:
        self._hpdl_heartbeat = asyncio.current_task()
        try:
            await super().heartbeat()
        finally:
            self._hpdl_heartbeat = None

    async def close(self, *args: Any, **kwargs: Any) -> Any:
        await stop_heartbeat(self)
        return await super().close(*args, **kwargs)


async def stop_heartbeat(dask_worker: Any, wait: float = HEARTBEAT_WAIT) -> None:
    """Stop a worker's heartbeat; with this module's `Worker`, also wait (at most `wait` s) for one in flight.

    Runs on the worker's event loop (also through `client.run`). A heartbeat that closes its own worker
    (the scheduler answered "missing") does not wait for itself."""
    callback = dask_worker.periodic_callbacks.get("heartbeat")
    if callback is not None:
        callback.stop()
    task = getattr(dask_worker, "_hpdl_heartbeat", None)
    if task is not None and task is not asyncio.current_task() and not task.done():
        await asyncio.wait({task}, timeout=wait)
