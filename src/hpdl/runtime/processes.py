"""The small pieces every launch needs: which mpiexec, process groups, and rank-labelled output lines."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from typing import IO, Any

__all__ = ["find_mpiexec", "mpiexec_flavour", "process_group", "relabel_lines", "tag_lines"]

RANK_LABEL = re.compile(r"^(?:(\d+)>|\[\d+,(\d+)\]<std(?:out|err)>: ?)")
"""gforker's `0>` and Open MPI's `[1,0]<stdout>: ` before a rank's line."""


def find_mpiexec() -> str:
    """The mpiexec beside this Python (pip's `mpich`), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError(
            "no mpiexec found: `pip install mpich` (or load your cluster's MPI module), or use --backend torch"
        )
    return found


@functools.cache
def mpiexec_flavour(mpiexec: str) -> str:
    """'hydra' (MPICH, MVAPICH, Intel MPI), 'openmpi' or 'unknown', from the launcher's own --version."""
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "HYDRA" in text.upper():
        return "hydra"
    if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text:
        return "openmpi"
    return "unknown"


def process_group(leader: int) -> dict[str, Any]:
    """Popen arguments that put the child in process group `leader` (0: a new group it leads)."""
    if sys.version_info >= (3, 11):
        return {"process_group": leader}
    return {"preexec_fn": lambda: os.setpgid(0, leader)}


def tag_lines(source: IO[bytes], sink: IO[str], rank: int) -> None:
    """Copy `source` to `sink`, each line after `[rank] `."""
    for raw in iter(source.readline, b""):
        sink.write(f"[{rank}] " + raw.decode(errors="replace"))
        sink.flush()
    source.close()


def relabel_lines(source: IO[bytes], sink: IO[str]) -> None:
    """gforker labels lines `0>`, Open MPI `[1,0]<stdout>: `; write them as `[0] ` like Hydra and torch jobs."""
    for raw in iter(source.readline, b""):
        sink.write(RANK_LABEL.sub(lambda m: f"[{m.group(1) or m.group(2)}] ", raw.decode(errors="replace"), count=1))
        sink.flush()
    source.close()
