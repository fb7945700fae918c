"""Flat units and their even split across ranks: the layout every ZeRO stage and its checkpoints share.

A *unit* is a group of parameters of one dtype and device laid end to end in
one flat buffer (row-major flattening of each parameter, in order). The flat
length is padded up to a multiple of the number of ranks N, and rank r owns
elements [r*S, (r+1)*S) with S = padded / N. Every unit is split evenly, so
every rank holds the same number of bytes of every unit (to one element of
padding), whatever the parameter sizes: partitions are balanced by bytes even
when nothing divides by N, and a unit's gradient is exactly one
`reduce_scatter` (equal blocks) and its parameters one `allgather`.

Parameter boundaries do not follow rank boundaries: a parameter may be split
across ranks. `Unit.pieces(rank)` gives, for each parameter, the part of it a
rank holds, as a flat [start, stop) range of the parameter's row-major
flattening; that is the "chunk" a sharded checkpoint records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["Slot", "Piece", "Unit", "plan_units", "split_by_bytes"]


@dataclass(frozen=True)
class Slot:
    """One parameter inside a unit's flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class Piece:
    """The part [start, stop) of parameter `name`'s flattening that one rank holds, at `shard_offset` in its shard."""

    name: str
    index: int
    """Position of the parameter in its unit."""
    start: int
    stop: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass
class Unit:
    """Parameters laid end to end and split evenly over `ranks` ranks (see the module docstring)."""

    index: int
    slots: list[Slot]
    ranks: int
    dtype: torch.dtype
    numel: int = field(init=False)
    padded: int = field(init=False)
    shard: int = field(init=False)

    def __post_init__(self) -> None:
        self.numel = sum(s.numel for s in self.slots)
        self.shard = -(-self.numel // self.ranks) if self.numel else 0
        self.padded = self.shard * self.ranks

    def bounds(self, rank: int) -> tuple[int, int]:
        """Rank `rank`'s [start, stop) in the padded flat buffer."""
        return rank * self.shard, (rank + 1) * self.shard

    def pieces(self, rank: int) -> list[Piece]:
        """The non-empty intersections of rank `rank`'s range with each parameter."""
        lo, hi = self.bounds(rank)
        out = []
        for index, slot in enumerate(self.slots):
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                out.append(Piece(slot.name, index, a - slot.offset, b - slot.offset, a - lo))
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the padded flat buffer (what one gathered unit costs)."""
        return self.padded * torch.empty(0, dtype=self.dtype).element_size()


def split_by_bytes(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive groups of indices into `sizes` (bytes), each at most `limit` bytes unless one item is larger."""
    groups: list[list[int]] = []
    filled = 0
    for i, size in enumerate(sizes):
        if not groups or filled + size > limit:
            groups.append([])
            filled = 0
        groups[-1].append(i)
        filled += size
    return groups


def plan_units(
    groups: Sequence[Sequence[tuple[str, torch.nn.Parameter]]], ranks: int, bucket_bytes: int = 0
) -> list[Unit]:
    """Units from groups of (name, parameter); with `bucket_bytes` > 0 each group is cut into units of at most
    that many bytes (and at every change of dtype or device). Empty groups give no unit."""
    if ranks < 1:
        raise ValueError(f"ranks={ranks} must be at least 1")
    units: list[Unit] = []
    for group in groups:
        runs: list[list[tuple[str, torch.nn.Parameter]]] = []
        for name, p in group:
            if runs and runs[-1][-1][1].dtype == p.dtype and runs[-1][-1][1].device == p.device:
                runs[-1].append((name, p))
            else:
                runs.append([(name, p)])
        for run in runs:
            sizes = [p.numel() * p.element_size() for _, p in run]
            cuts = split_by_bytes(sizes, bucket_bytes) if bucket_bytes > 0 else [list(range(len(run)))]
            for cut in cuts:
                slots, offset = [], 0
                for i in cut:
                    name, p = run[i]
                    slots.append(Slot(name, tuple(p.shape), offset, p.numel()))
                    offset += p.numel()
                units.append(Unit(len(units), slots, ranks, run[cut[0]][1].dtype))
    return units
