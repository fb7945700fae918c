"""Micro-batches: split a batch (a tensor or a tuple of tensors) along dim 0, unevenly where it must.

A batch of B rows in m chunks gives min(m, B) micro-batches; the first
B % m of them get one row more (as `torch.tensor_split`). Each
micro-batch's loss is weighted by its share of the rows, so that a mean-
reduced loss gives the gradient of the whole batch however the rows fell.
"""

from __future__ import annotations

from typing import Any, Union

import torch

__all__ = ["Batch", "as_tensors", "split", "sizes", "batch_size", "join"]

Batch = Union[torch.Tensor, tuple]
"""What a stage takes and returns: one tensor, or a tuple of tensors."""


def as_tensors(value: Any, what: str) -> tuple[torch.Tensor, ...]:
    """`value` as a tuple of tensors (a lone tensor becomes a 1-tuple); anything else is a TypeError."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    for i, item in enumerate(items):
        if not isinstance(item, torch.Tensor):
            raise TypeError(
                f"{what} must be a tensor or a tuple of tensors; item {i} is {type(item).__name__}. "
                "Carry other values inside the stage modules, or encode them as tensors."
            )
    return tuple(items)


def batch_size(value: Batch, what: str) -> int:
    """The common dim-0 size of the tensors of `value` (a ValueError when they differ or are 0-d)."""
    tensors = as_tensors(value, what)
    if not tensors:
        raise ValueError(f"{what} is an empty tuple; pass at least one tensor")
    rows = set()
    for t in tensors:
        if t.dim() == 0:
            raise ValueError(f"{what} holds a 0-d tensor; micro-batches split dim 0, so every tensor needs one")
        rows.add(t.shape[0])
    if len(rows) > 1:
        raise ValueError(f"{what}: its tensors have different dim-0 sizes {sorted(rows)}; they must agree")
    return rows.pop()


def sizes(rows: int, chunks: int) -> list[int]:
    """Rows per micro-batch: min(chunks, rows) parts, the first rows % parts of them one row larger."""
    if rows < 1:
        raise ValueError(f"a batch of {rows} rows cannot be split into micro-batches; pass at least one row")
    parts = min(chunks, rows)
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def split(value: Batch, chunks: int, what: str = "the batch") -> list[Batch]:
    """`value` cut into micro-batches along dim 0 (views, no copies); tuples stay tuples."""
    rows = batch_size(value, what)
    counts = sizes(rows, chunks)
    if isinstance(value, torch.Tensor):
        return list(value.split(counts))
    pieces = [t.split(counts) for t in value]
    return [tuple(p[i] for p in pieces) for i in range(len(counts))]


def join(parts: list[Batch]) -> Batch:
    """The micro-batches' outputs concatenated back into one batch (the inverse of `split`)."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)  # type: ignore[arg-type]
    return tuple(torch.cat([p[i] for p in parts]) for i in range(len(parts[0])))
