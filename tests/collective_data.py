"""Inputs that every rank can compute for every other rank, and the results a reduction must give.

Values are small integers, exact in every dtype (float16 and bfloat16
included), so expected results are exact and comparisons can be equality.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int8, torch.uint8, torch.int32, torch.int64)
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES + (torch.bool,)
SIZES = (0, 1, 7, 1000)
LARGE = 1 << 22  # 16 MB of float32: past every eager/rendezvous threshold of the engines
SHM_FORCED = {
    "HPDL_SHM_MIN_ALLREDUCE": "0",
    "HPDL_SHM_MIN_REDUCE_SCATTER": "0",
    "HPDL_SHM_MIN_ALLGATHER": "0",
    "HPDL_SHM_MIN_BROADCAST": "0",
    "HPDL_SHM_MIN_ALLREDUCE_COALESCED": "0",  # fusion buckets straight from and into their tensors
    "HPDL_SHM_MB": "0.25",  # 256 KB of staging per rank: every larger tensor goes through in pieces
    "HPDL_SHM_PIECE_MB": "0.0625",  # of 64 KB, staged round the segment's 4 slots
}
"""Every collective through the shared-memory engine: one environment for test_collectives and
test_shared_memory, which run on one pytest worker (conftest.SHARED_POOLS) and so share its rank pools."""
HIERARCHICAL = dict(SHM_FORCED, HPDL_RANKS_PER_NODE="2")
"""The same on 4 ranks split into 2 nodes of 2: the hierarchical allreduce."""


def make_input(rank: int, n: int, dtype: torch.dtype, op: str = "sum") -> torch.Tensor:
    index = torch.arange(n)
    if dtype == torch.bool:
        return (index + rank) % 3 == 0
    if op == "prod":
        return ((index + rank) % 2 + 1).to(dtype)
    return ((index + 3 * rank) % 5 + 1).to(dtype)


def expected_reduce(size: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    stack = torch.stack([make_input(r, n, dtype, op).to(torch.float64) for r in range(size)])
    if dtype == torch.bool:
        return (stack.amax(0) if op in ("sum", "max") else stack.amin(0)).bool()
    reduced = {
        "sum": lambda: stack.sum(0),
        "avg": lambda: stack.mean(0),
        "max": lambda: stack.amax(0),
        "min": lambda: stack.amin(0),
        "prod": lambda: stack.prod(0),
    }[op]()
    return reduced.to(dtype)


def ops_for(dtype: torch.dtype) -> tuple[str, ...]:
    return ("sum", "avg", "max", "min", "prod") if dtype.is_floating_point else ("sum", "max", "min", "prod")
