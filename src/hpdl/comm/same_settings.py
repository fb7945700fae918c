"""Settings every rank of an MPI communicator must share, compared once when the communicator is made.

Each rank reads from its own environment which path a collective takes (shared memory or MPI, and which MPI
call), how the staging segment is cut into pieces, how often the agreement check votes, whether debug
fingerprints run and how tensor fusion cuts its buckets. Ranks that read different values take different paths
for one call: a hang until the timeout, or wrong values. One bounded MPI_MAX over (value, -value) per setting
tells every rank whether they agree; where they do not, every rank gathers the values and raises the same error,
naming the setting and each rank's value.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from hpdl.comm import shm
from hpdl.comm.work import wait_for

__all__: list[str] = []


def agree(mpi_comm: Any, settings: dict[str, int], timeout: float) -> None:
    """Return when every rank of `mpi_comm` has the same `settings` (name -> integer); else raise ValueError on
    every rank. Both collectives are bounded by `timeout`."""
    from mpi4py import MPI

    names = list(settings)
    mine = np.array([settings[name] for name in names], dtype=np.int64)
    extremes = np.concatenate([mine, -mine])
    deadline = time.perf_counter() + timeout
    _bounded(mpi_comm.Iallreduce(MPI.IN_PLACE, [extremes, MPI.INT64_T], op=MPI.MAX), deadline, timeout)
    differ = [i for i, name in enumerate(names) if extremes[i] != -extremes[len(names) + i]]
    if not differ:
        return
    every = np.zeros((mpi_comm.Get_size(), len(names)), dtype=np.int64)
    _bounded(mpi_comm.Iallgather([mine, MPI.INT64_T], [every, MPI.INT64_T]), deadline, timeout)
    lines = [
        f"{names[i]}: " + ", ".join(f"rank {rank} {_shown(int(value))}" for rank, value in enumerate(every[:, i]))
        for i in differ
    ]
    raise ValueError(
        "hpdl: the ranks of this communicator do not share these settings, so they would take different paths "
        "for the same collective (a hang or wrong values): " + "; ".join(lines) + ". They come from each rank's "
        "environment (HPDL_* variables) or from hpdl.init's arguments: set the same values on every rank."
    )


def _shown(value: int) -> str:
    return "never" if value >= shm.NEVER else str(value)


def _bounded(request: Any, deadline: float, timeout: float) -> None:
    wait_for(request, deadline, timeout, "hpdl: comparing the ranks' settings (a new communicator)", "settings")
