"""Shared by the SPMD ml tests: uneven row shards and a sub-communicator of the pool's first ranks."""

from __future__ import annotations

import numpy as np


def bounds(n: int, size: int, empty_rank: int | None) -> list[tuple[int, int]]:
    """Uneven shards (rank r gets a share ~ r + 1); `empty_rank` gets none."""
    shares = np.array([0 if r == empty_rank else r + 1 for r in range(size)], dtype=float)
    edges = np.concatenate([[0], np.round(np.cumsum(shares) / shares.sum() * n)]).astype(int)
    return [(int(edges[r]), int(edges[r + 1])) for r in range(size)]


def first_ranks(comm, nranks: int):
    """The first `nranks` ranks of the pool (comm.split), or None on the others."""
    if comm.size == nranks:
        return comm
    return comm.split(0 if comm.rank < nranks else None, comm.rank)
