"""Horovod's timeline (`hvd.start_timeline` / `stop_timeline`): a Chrome-trace JSON of the named operations.

Each operation appears twice, as in Horovod's: `NEGOTIATE_<KIND>` from
submission until every rank agreed, then `<KIND>` until it finished;
`mark_cycles=True` adds a `CYCLE_START` mark per negotiation round. Rank 0
writes the file (Horovod's coordinator does), when the timeline stops.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Optional

__all__ = ["start_timeline", "stop_timeline"]


class _Timeline:
    def __init__(self, path: str, mark_cycles: bool, rank: int):
        self.path = path
        self.mark_cycles = mark_cycles
        self.rank = rank
        self.origin = time.time()
        self.events: list[dict[str, Any]] = []
        self.open: dict[str, tuple[str, float]] = {}
        self.pids: dict[str, int] = {}

    def now_us(self) -> float:
        return (time.time() - self.origin) * 1e6

    def pid(self, name: str) -> int:
        if name not in self.pids:
            self.pids[name] = len(self.pids) + 1
            self.events.append({"name": "process_name", "ph": "M", "pid": self.pids[name], "args": {"name": name}})
        return self.pids[name]

    def write(self) -> None:
        if self.rank != 0:
            return
        header = {"name": "hpdl.horovod", "ph": "M", "pid": 0,
                  "args": {"start_time_since_epoch_in_micros": int(self.origin * 1e6)}}  # fmt: skip
        with open(self.path, "w") as f:
            json.dump([header, *self.events], f)


_active: Optional[_Timeline] = None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record the named operations of this process into `file_path` (rank 0 writes it at stop)."""
    global _active
    from hpdl.horovod import basics

    if _active is not None:
        _active.write()
    directory = os.path.dirname(os.path.abspath(file_path))
    if not os.path.isdir(directory):
        raise ValueError(f"start_timeline: directory {directory} does not exist")
    _active = _Timeline(file_path, bool(mark_cycles), basics.rank())


def stop_timeline() -> None:
    """Stop recording and write the file."""
    global _active
    if _active is not None:
        _active.write()
    _active = None


def begin(name: str, phase: str) -> None:
    if _active is None:
        return
    t = _active
    t.open[name] = (phase, t.now_us())
    t.events.append({"name": phase, "ph": "B", "ts": t.now_us(), "pid": t.pid(name), "tid": 1})


def end(name: str) -> None:
    if _active is None:
        return
    t = _active
    if t.open.pop(name, None) is not None:
        t.events.append({"ph": "E", "ts": t.now_us(), "pid": t.pid(name), "tid": 1})


def active() -> bool:
    return _active is not None


def marking_cycles() -> bool:
    return _active is not None and _active.mark_cycles


def instant(name: str) -> None:
    if _active is not None:
        _active.events.append({"name": name, "ph": "i", "ts": _active.now_us(), "pid": 0, "tid": 1, "s": "g"})
