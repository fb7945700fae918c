"""pytest-xdist scheduling for the suite: whole files per worker, named groups of files as one unit, and a worker
that dies costs its one test, not the run.

Files that start the same rank pools go to one worker as one unit (conftest.SHARED_POOLS), which then starts
each pool once. xdist's own `--dist loadgroup` renames node ids, which pytest 9 no longer lets it do.

A worker dies when a test takes the interpreter down (a segfault in a native library, the kernel's OOM killer).
xdist 3.8's file scheduling then hangs the whole run instead of going on (pytest-xdist#1323, #1327, #1378): it
puts every unit the dead worker ever had back on the queue, the finished ones and the test that killed it
included, so the replacement worker runs that test again (and dies again), and a finished unit sent again
never reports back. Here the dead worker's test is reported failed once (by xdist) and the rest of its units
go on elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

import pytest
from xdist.scheduler import LoadScopeScheduling

__all__ = ["FileGroups"]


class FileGroups(LoadScopeScheduling):
    def __init__(self, config: pytest.Config, log: Any, groups: Mapping[str, str]) -> None:
        super().__init__(config, log)
        self.groups = dict(groups)
        """file name -> group name; a file not named is a group of its own."""

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return self.groups.get(os.path.basename(path), path)

    def remove_node(self, node: Any) -> Optional[str]:
        """Forget a worker that ended; when it died mid-unit, return the test it died in (xdist reports it failed)
        and give its unfinished units to the others, next in line."""
        workload = self.assigned_work.pop(node)
        crashed = next((nodeid for unit in workload.values() for nodeid, done in unit.items() if not done), None)
        if crashed is None:
            return None
        for unit in workload.values():
            if crashed in unit:
                unit[crashed] = True  # not run again: it would take the next worker down too
        unfinished = [(scope, unit) for scope, unit in workload.items() if not all(unit.values())]
        for scope, unit in reversed(unfinished):  # to the front of the queue, in the order the dead worker had them
            self.workqueue[scope] = unit
            self.workqueue.move_to_end(scope, last=False)
        for other in self.nodes:
            self._reschedule(other)
        return crashed

    def _reschedule(self, node: Any) -> None:
        """Give `node` another unit when it is nearly done (as xdist does), and more while it holds fewer than two
        tests to run: a worker runs a test only once it knows the next one, or that none will come (a replacement
        worker given the dead worker's last test alone would wait for ever). Once nothing is left, say so."""
        if node.shutting_down or node not in self.registered_collections:
            return  # (a replacement still collecting is scheduled once its collection arrives: pytest-xdist#1189)
        if self.workqueue and self._pending_of(self.assigned_work[node]) <= 2:
            if not self._give(node):
                return
            while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
                if not self._give(node):
                    return
        if not self.workqueue:
            node.shutdown()

    def _give(self, node: Any) -> bool:
        """Send `node` the next unit; False when it has died since its last report (its unit stays first in line
        for the others: xdist's notice of the death follows)."""
        scope, unit = next(iter(self.workqueue.items()))
        try:
            self._assign_work_unit(node)
        except OSError:  # execnet: "cannot send (already closed?)"
            self.assigned_work[node].pop(scope, None)
            self.workqueue[scope] = unit
            self.workqueue.move_to_end(scope, last=False)
            return False
        return True
