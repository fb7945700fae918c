"""Several split dimensions at once: the ranks on a grid, one sub-communicator per split dimension.

A 2-D split of an image over 4 ranks puts them on a 2 x 2 grid (row-major:
rank 1 holds the top-right block). Each rank's block is the even split of
every split dimension at its grid coordinate. A halo exchange along one
dimension talks only to the ranks that share the other coordinates (the
axis group), so each split dimension gets its own sub-communicator. The
exchanges run one dimension after the other, the last first: the rows
sent along the first dimension already carry the other dimensions' halos,
which brings the corner (diagonal) halos without a message of their own.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

from hpdl.comm.base import Communicator

__all__ = ["grid_shape", "coordinates", "axis_groups", "normalize_split"]


def grid_shape(ranks: int, axes: int) -> tuple[int, ...]:
    """The most even grid of `ranks` with `axes` factors, largest first (4 ranks, 2 axes: 2 x 2; 6: 3 x 2)."""
    if axes == 1:
        return (ranks,)
    best: tuple[int, ...] = ()
    for first in range(1, ranks + 1):
        if ranks % first:
            continue
        rest = grid_shape(ranks // first, axes - 1)
        candidate = tuple(sorted((first, *rest), reverse=True))
        if not best or max(candidate) - min(candidate) < max(best) - min(best):
            best = candidate
    return best


def coordinates(rank: int, grid: Sequence[int]) -> tuple[int, ...]:
    """Rank's position on the grid, row-major (the last axis varies fastest)."""
    coords = []
    for parts in reversed(grid):
        rank, c = divmod(rank, parts)
        coords.append(c)
    return tuple(reversed(coords))


def normalize_split(
    dim: Union[int, Sequence[int]], grid: Union[None, Sequence[int]], ranks: int, where: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(dims, grid) checked: dims distinct spatial dimensions (>= 2), one grid factor each, their product = ranks."""
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not dims or any(not isinstance(d, int) or d < 2 for d in dims) or len(set(dims)) != len(dims):
        raise ValueError(
            f"{where}: dim={dim!r} must be a spatial dimension (2 for the height of NCHW / the depth of NCDHW) or a "
            "tuple of distinct ones, e.g. (2, 3) for height x width"
        )
    if grid is None:
        shape = grid_shape(ranks, len(dims))
    else:
        shape = tuple(int(g) for g in grid)
        if len(shape) != len(dims) or any(g < 1 for g in shape):
            raise ValueError(f"{where}: grid={tuple(grid)!r} needs one positive factor per split dim {dims}")
    if math.prod(shape) != ranks:
        factors = " * ".join(f"dim {d}({g})" for d, g in zip(dims, shape))
        raise ValueError(f"{where}: grid {factors} = {math.prod(shape)} != the group's {ranks} ranks")
    return dims, shape


def axis_groups(comm: Communicator, grid: Sequence[int]) -> list[Communicator]:
    """Per grid axis, the sub-communicator of the ranks that share every other coordinate, ranked by their
    coordinate along the axis (collective: every rank of `comm` calls it). A one-axis grid is `comm` itself."""
    if len(grid) == 1:
        return [comm]
    mine = coordinates(comm.rank, grid)
    groups = []
    for axis in range(len(grid)):
        color = 0  # the other coordinates, raveled
        for i, (c, parts) in enumerate(zip(mine, grid)):
            if i != axis:
                color = color * parts + c
        group = comm.split(color, key=mine[axis])
        if group is None:  # split returns None only for color=None
            raise RuntimeError("spatial: a grid axis group came back empty")
        groups.append(group)
    return groups
