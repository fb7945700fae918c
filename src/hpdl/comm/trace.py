"""Per-rank timelines written as one Chrome-trace / Perfetto JSON file.

Each rank records complete events (name, start, end); `write` gathers them to
rank 0, which writes one file with a track per rank (`pid` = rank), so that
overlap of communication with compute can be seen in chrome://tracing or
ui.perfetto.dev. Times are wall-clock microseconds so that ranks line up.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Protocol

__all__ = ["Tracer"]


class _Gathers(Protocol):
    """What `Tracer.write` needs of a communicator (`hpdl.comm.base.Communicator` imports this module)."""

    @property
    def rank(self) -> int: ...

    def allgather_object(self, obj: Any) -> list: ...


class Tracer:
    """Collects this rank's events; attach with `comm.tracer = Tracer()`."""

    def __init__(self) -> None:
        # One anchor per process maps the monotonic clock onto wall time.
        self._perf0 = time.perf_counter()
        self._wall0_us = time.time() * 1e6
        self.events: list[dict[str, Any]] = []

    def _us(self, perf: float) -> float:
        return self._wall0_us + (perf - self._perf0) * 1e6

    def complete(self, name: str, start: float, end: float, category: str = "compute", **args: Any) -> None:
        """Record an event that ran from `start` to `end` (time.perf_counter() values)."""
        self.events.append(
            {"name": name, "cat": category, "ph": "X", "ts": self._us(start), "dur": (end - start) * 1e6, "args": args}
        )

    @contextmanager
    def span(self, name: str, category: str = "compute", **args: Any) -> Iterator[None]:
        """Record the enclosed block as one event."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.complete(name, start, time.perf_counter(), category, **args)

    def write(self, path: str, comm: _Gathers) -> Optional[str]:
        """Gather every rank's events and write one trace on rank 0 (collective); return the path there."""
        gathered = comm.allgather_object(self.events)
        if comm.rank != 0:
            return None
        trace = []
        for rank, events in enumerate(gathered):
            trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
            trace.extend(dict(event, pid=rank, tid=0) for event in events)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as handle:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, handle)
        os.replace(tmp, path)
        return path
