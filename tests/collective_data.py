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
