"""How long the split dimension is globally, known to every layer without a collective per step.

Each rank holds only its slab, so a layer learns the global number of
rows from one tiny allgather of the slab sizes. `SpatialContext` caches
the answer per (wrapper input size, layer, call number within the
forward): every rank hits or misses the cache together, so the
collective is only ever issued by all ranks at once, and after the first
step at a given image size no layer issues it again.
"""

from __future__ import annotations

from typing import Optional

import torch

from hpdl.comm.base import Communicator
from hpdl.parallel.spatial.partition import even_split

__all__ = ["SpatialContext", "global_rows"]


class SpatialContext:
    """State shared by the layers of one spatially parallel model during a forward."""

    def __init__(self) -> None:
        self.key: Optional[tuple] = None
        self.calls: dict[int, int] = {}
        self.cache: dict[tuple, int] = {}

    def begin(self, key: tuple) -> None:
        self.key = key
        self.calls = {}

    def next_call(self, layer_id: int) -> int:
        call = self.calls.get(layer_id, 0)
        self.calls[layer_id] = call + 1
        return call


def slab_sizes(rows: int, comm: Communicator, device: torch.device) -> list[int]:
    """Every rank's number of rows (one allgather of one integer)."""
    if comm.size == 1:
        return [rows]
    mine = torch.tensor([rows], dtype=torch.int64)
    return [int(v) for v in comm.allgather(mine, sizes=[1] * comm.size).tolist()]


def global_rows(
    x: torch.Tensor, dim: int, comm: Communicator, context: Optional[SpatialContext], layer_id: int, layer: str
) -> tuple[int, int]:
    """(global rows along `dim`, call number) of this layer's input slab `x`; checks the slabs are the even split."""
    if x.dim() <= dim:
        raise ValueError(
            f"{layer}: input of shape {tuple(x.shape)} has no dimension {dim} to split (batched input expected)"
        )
    rows = x.shape[dim]
    call = 0
    key = None
    if context is not None:
        call = context.next_call(layer_id)
        if context.key is not None:
            key = (context.key, layer_id, call)
            cached = context.cache.get(key)
            if cached is not None:
                expected = even_split(cached, comm.size)[comm.rank]
                if rows != expected[1] - expected[0]:
                    raise ValueError(
                        f"{layer}: this rank's slab has {rows} rows where the even split of {cached} rows over "
                        f"{comm.size} ranks gives it {expected[1] - expected[0]}; feed slabs made by shard()"
                    )
                return cached, call
    sizes = slab_sizes(rows, comm, x.device)
    total = sum(sizes)
    want = [b - a for a, b in even_split(total, comm.size)]
    if sizes != want:
        raise ValueError(
            f"{layer}: the ranks' slabs have {sizes} rows along dim {dim}; the even split of {total} rows is {want} "
            f"(the first ranks one row longer): cut the input with hpdl.parallel.spatial.shard()"
        )
    if key is not None and context is not None:
        context.cache[key] = total
    return total, call
