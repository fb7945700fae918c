"""`TPShard`: where a tensor-parallel rank's local tensor sits inside the full (logical) tensor.

A split parameter is cut along one dimension into `size` equal slices, one
per tp rank. A fused query/key/value weight is cut per block (`parts=3`):
rank r holds rows r of the query block, of the key block and of the value
block, so that each rank owns whole attention heads. A rank's piece is
therefore `parts` N-d boxes of the full tensor, which is what sharded
checkpoints store, and what `take` / `place` use to move between the full
tensor and the local one. Parameters without a `TPShard` are replicated on
every tp rank (layer norms, row-parallel biases, position embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["TPShard", "Box"]

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, sizes) of an N-d block of the full tensor."""


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size` holds, along `dim`, its slice of each of `parts` equal blocks of `global_shape`."""

    global_shape: tuple[int, ...]
    dim: int
    rank: int
    size: int
    parts: int = 1

    def __post_init__(self) -> None:
        extent = self.global_shape[self.dim]
        if extent % (self.parts * self.size):
            raise ValueError(
                f"TPShard: dimension {self.dim} of {self.global_shape} ({extent}) does not split into "
                f"{self.parts} block(s) x {self.size} ranks"
            )

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        shape[self.dim] //= self.size
        return tuple(shape)

    def pieces(self, rank: Optional[int] = None) -> list[tuple[slice, slice]]:
        """(local slice, global slice) along `dim` for each block held by `rank` (default: this shard's)."""
        r = self.rank if rank is None else rank
        block = self.global_shape[self.dim] // self.parts
        width = block // self.size
        return [
            (slice(j * width, (j + 1) * width), slice(j * block + r * width, j * block + (r + 1) * width))
            for j in range(self.parts)
        ]

    def boxes(self, rank: Optional[int] = None) -> list[Box]:
        """The N-d boxes of the full tensor that `rank` holds, in local order."""
        out = []
        for _, g in self.pieces(rank):
            offsets = [0] * len(self.global_shape)
            sizes = list(self.global_shape)
            offsets[self.dim], sizes[self.dim] = g.start, g.stop - g.start
            out.append((tuple(offsets), tuple(sizes)))
        return out

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor cut out of the full one (a new contiguous tensor)."""
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"TPShard.take: got a tensor of shape {tuple(full.shape)}, expected {self.global_shape}")
        return torch.cat([full.narrow(self.dim, g.start, g.stop - g.start) for _, g in self.pieces()], dim=self.dim)

    def place(self, local: torch.Tensor, full: torch.Tensor, rank: Optional[int] = None) -> None:
        """Write `rank`'s local tensor into its place in `full`."""
        for lo, g in self.pieces(rank):
            full.narrow(self.dim, g.start, g.stop - g.start).copy_(local.narrow(self.dim, lo.start, lo.stop - lo.start))

    def assemble(self, locals_by_rank: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every tp rank's local tensor (rank order)."""
        full = torch.empty(self.global_shape, dtype=locals_by_rank[0].dtype, device=locals_by_rank[0].device)
        for r, local in enumerate(locals_by_rank):
            self.place(local, full, r)
        return full
