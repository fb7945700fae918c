"""The hosts of a job across machines: `-H a:2,b:2` (horovodrun, mpirun), a hostfile, and how each MPI reaches them.

A hostfile has one host a line, in mpirun's forms: `host slots=N`, `host:N` or `host` (one slot); `#` starts
a comment. Ranks fill the hosts in order, each up to its slots (a job of fewer ranks than slots leaves the
last hosts out; of more, is refused: hpdl does not oversubscribe remote hosts silently).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from typing import Optional

__all__ = ["Hosts", "parse_hostfile", "parse_hosts", "reachable"]

_ENTRY = re.compile(r"^(?P<host>[A-Za-z0-9_.\-\[\]:]+?)(?::(?P<colon>\d+))?(?:\s+slots\s*=\s*(?P<slots>\d+))?$")


@dataclass(frozen=True)
class Hosts:
    """Hosts and their slots, in order."""

    slots: tuple[tuple[str, int], ...]

    def placement(self, nprocs: int) -> list[tuple[str, int]]:
        """How many of `nprocs` ranks each host runs (in order, each up to its slots); ValueError when too few."""
        total = sum(n for _, n in self.slots)
        if nprocs > total:
            listed = ", ".join(f"{h}:{n}" for h, n in self.slots)
            raise ValueError(f"-n {nprocs} ranks but the hosts have {total} slots ({listed}): give more slots or hosts")
        placed, left = [], nprocs
        for host, n in self.slots:
            if left == 0:
                break
            placed.append((host, min(n, left)))
            left -= min(n, left)
        return placed

    @property
    def total(self) -> int:
        return sum(n for _, n in self.slots)

    def spec(self, nprocs: int) -> str:
        """`a:2,b:2`, the form Hydra's `-hosts` and Open MPI's `-H` both take."""
        return ",".join(f"{host}:{n}" for host, n in self.placement(nprocs))


def _entry(text: str, where: str) -> tuple[str, int]:
    found = _ENTRY.match(text.strip())
    if not found or (found["colon"] and found["slots"]):
        raise ValueError(f"{where}: {text.strip()!r} is not `host`, `host:N` or `host slots=N`")
    slots = int(found["colon"] or found["slots"] or 1)
    if slots < 1:
        raise ValueError(f"{where}: {text.strip()!r} has no slots")
    return found["host"], slots


def parse_hosts(spec: str) -> Hosts:
    """`a:2,b:2` (or `a,b`: one slot each)."""
    entries = [part for part in spec.split(",") if part.strip()]
    if not entries:
        raise ValueError("-H: name the hosts, e.g. -H a:2,b:2")
    return Hosts(tuple(_entry(part, "-H") for part in entries))


def parse_hostfile(path: str) -> Hosts:
    """An mpirun-style hostfile."""
    entries = []
    with open(path) as source:
        for number, line in enumerate(source, 1):
            text = line.split("#", 1)[0].strip()
            if text:
                entries.append(_entry(text, f"{path}:{number}"))
    if not entries:
        raise ValueError(f"{path}: no hosts in the hostfile")
    return Hosts(tuple(entries))


def reachable(hosts: Hosts, rsh: str, seconds: float = 15.0) -> tuple[Optional[Hosts], list[str]]:
    """The hosts that answer `rsh HOST true` within `seconds` (None if none does), and why each other did not."""
    kept, lost = [], []
    for host, slots in hosts.slots:
        try:
            done = subprocess.run(
                [rsh, host, "true"], capture_output=True, text=True, timeout=seconds, stdin=subprocess.DEVNULL
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            lost.append(f"{host}: {error}")
            continue
        if done.returncode == 0:
            kept.append((host, slots))
        else:
            lost.append(f"{host}: {(done.stderr.strip().splitlines() or [f'exit code {done.returncode}'])[-1]}")
    return (Hosts(tuple(kept)) if kept else None), lost
