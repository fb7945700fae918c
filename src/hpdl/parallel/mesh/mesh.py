"""`Mesh`: one world split into dp x pp x tp x sp sub-communicators (`build`, in `compose`, applies a plan on it).

    mesh = hpdl.parallel.Mesh(comm, dp=2, pp=2, tp=1)          # -1 infers one degree
    mesh.dp, mesh.pp, mesh.tp, mesh.sp                          # sub-communicators (Communicator)
    model, optimizer = hpdl.parallel.build(model, mesh, plan)   # tp, then pipeline, then dp / ZeRO

Rank placement: the axes are laid out from innermost (consecutive world
ranks) to outermost, by default tp, sp, dp, pp: a tensor-parallel group is
a run of consecutive ranks, which launchers put on one node (tp exchanges
activations in every layer, so it needs the fastest links), and so is a
spatial group (halos in every layer); pipeline stages are outermost, across
nodes (they exchange one activation per micro-batch).
`placement=("dp", "tp", "sp", "pp")` and the like override it (a placement
of the other three axes gets "sp" right after "tp"). Every rank calls the
constructor (it splits the communicator once per axis).
"""

from __future__ import annotations

import logging
import math
from typing import Optional, Sequence

from hpdl.comm.base import Communicator
from hpdl.parallel.mesh.plan_config import AXES, DEGREES, Plan, PlanError, full_placement, resolve_degrees

__all__ = ["Mesh", "group_members", "crossing_groups"]

log = logging.getLogger(__name__)


class Mesh:
    """The world as a dp x pp x tp x sp grid; `dp`, `pp`, `tp`, `sp` are this rank's sub-communicators.

    Each holds the ranks that share this rank's coordinates on the other
    axes: `mesh.dp` the replicas that split the batch, `mesh.pp` one rank per
    pipeline stage, `mesh.tp` the ranks that split each layer's weights,
    `mesh.sp` the ranks that split each sample's activations (spatial).
    `mesh.group("dp", "sp")` is the ranks along several axes at once.
    """

    def __init__(
        self,
        comm: Communicator,
        *,
        dp: int = -1,
        pp: int = 1,
        tp: int = 1,
        sp: int = 1,
        placement: Sequence[str] = AXES,
    ):
        if not isinstance(comm, Communicator):
            raise TypeError(f"Mesh: comm must be an hpdl Communicator (hpdl.init()), got {type(comm).__name__}")
        placement = full_placement(placement)
        if sorted(placement) != sorted(AXES):
            raise ValueError(f"Mesh: placement={list(placement)} must order the axes {list(AXES)}, innermost first")
        self.world = comm
        self.placement = placement
        try:
            self.shape: dict[str, int] = resolve_degrees(comm.size, dp, pp, tp, sp)
        except PlanError as exc:
            raise ValueError(f"Mesh: {exc}") from None
        self.coords = self._coordinates(comm.rank)
        self._groups: dict[tuple[str, ...], Communicator] = {}
        for axis in DEGREES:  # the same order on every rank: split is collective
            self._groups[(axis,)] = self._split((axis,))
        self.dp, self.pp, self.tp, self.sp = (self._groups[(a,)] for a in DEGREES)
        self._warn_if_tp_crosses_nodes()

    def _split(self, axes: tuple[str, ...]) -> Communicator:
        """The ranks that share this rank's coordinates on every axis but `axes`, ranked along them."""
        color = key = 0
        for axis in DEGREES:
            if axis in axes:
                key = key * self.shape[axis] + self.coords[axis]
            else:
                color = color * self.shape[axis] + self.coords[axis]
        sub = self.world.split(color, key=key)
        size = math.prod(self.shape[a] for a in axes)
        if sub is None or sub.size != size or sub.rank != key:
            raise RuntimeError(f"Mesh: the {' x '.join(axes)} split of rank {self.world.rank} gave {sub!r}")
        return sub

    def group(self, *axes: str) -> Communicator:
        """The ranks along `axes` together (e.g. "dp", "sp": the gradient group of sample + spatial parallelism).

        Collective over the world the first time a combination is asked for; kept after that.
        """
        unknown = [a for a in axes if a not in DEGREES]
        if not axes or unknown or len(set(axes)) != len(axes):
            raise ValueError(f"Mesh.group: axes {list(axes)} must be distinct names among {list(DEGREES)}")
        chosen = tuple(a for a in DEGREES if a in axes)
        if chosen not in self._groups:
            self._groups[chosen] = self._split(chosen)
        return self._groups[chosen]

    # ------------------------------------------------------------------ coordinates
    def _coordinates(self, rank: int) -> dict[str, int]:
        coords, rest = {}, rank
        for axis in self.placement:  # innermost first: rank = c0 + n0 * (c1 + n1 * c2)
            coords[axis] = rest % self.shape[axis]
            rest //= self.shape[axis]
        return coords

    def coordinates(self, rank: Optional[int] = None) -> dict[str, int]:
        """{"tp": k, "sp": l, "dp": i, "pp": j} of `rank` (default: this rank), innermost axis first."""
        return dict(self.coords) if rank is None else self._coordinates(rank)

    def rank_of(self, *, dp: int, pp: int, tp: int, sp: int = 0) -> int:
        """The world rank at these coordinates."""
        coords = {"dp": dp, "pp": pp, "tp": tp, "sp": sp}
        for axis, value in coords.items():
            if not 0 <= value < self.shape[axis]:
                raise ValueError(f"Mesh.rank_of: {axis}={value} is outside 0..{self.shape[axis] - 1}")
        return _rank(self.shape, self.placement, coords)

    @property
    def size(self) -> int:
        return self.world.size

    def _warn_if_tp_crosses_nodes(self) -> None:
        """Tensor and spatial groups talk in every layer: rank 0 says which of them span more than a node.

        Launchers place consecutive world ranks on one node, `local_size` of them per node.
        """
        local = self.world.local_size
        if self.world.rank != 0 or local <= 1 or local >= self.world.size:
            return
        for axis, what in (("tp", "tensor-parallel"), ("sp", "spatial")):
            crossing = crossing_groups(self.shape, self.placement, axis, local)
            if crossing:
                log.warning(
                    "Mesh: %d %s group(s) span nodes of %d ranks (e.g. ranks %s): every layer's exchange crosses "
                    "nodes. Put %r first in placement and keep %s <= %d.",
                    len(crossing),
                    what,
                    local,
                    crossing[0],
                    axis,
                    axis,
                    local,
                )

    def describe(self) -> str:
        """The grid: degrees, placement and every world rank's coordinates."""
        head = (
            f"Mesh {' x '.join(f'{a}={self.shape[a]}' for a in DEGREES)} = {self.size} ranks "
            f"(innermost first: {', '.join(self.placement)})"
        )
        rows = [
            f"  rank {r}: " + " ".join(f"{a}={c}" for a, c in self._coordinates(r).items()) for r in range(self.size)
        ]
        return "\n".join([head, *rows])

    def __repr__(self) -> str:
        degrees = ", ".join(f"{a}={self.shape[a]}" for a in DEGREES)
        at = " ".join(f"{a}={self.coords[a]}" for a in DEGREES)
        return f"Mesh({degrees}; rank {self.world.rank} at {at})"

    @classmethod
    def from_plan(cls, comm: Communicator, plan: Plan) -> Mesh:
        """The mesh of `plan`'s degrees and placement over `comm`."""
        return cls(comm, dp=plan.dp, pp=plan.pp, tp=plan.tp, sp=plan.sp, placement=plan.placement)

    def close(self) -> None:
        """Release the sub-communicators (the world stays open)."""
        for sub in reversed(list(self._groups.values())):
            sub.close()
        self._groups.clear()


def _rank(shape: dict[str, int], placement: Sequence[str], coords: dict[str, int]) -> int:
    """rank = c0 + n0 * (c1 + n1 * (...)) along the placement, innermost first."""
    rank, stride = 0, 1
    for axis in placement:
        rank += coords[axis] * stride
        stride *= shape[axis]
    return rank


def group_members(shape: dict[str, int], placement: Sequence[str], coords: dict[str, int], axis: str) -> list[int]:
    """The world ranks of the `axis` group through `coords` (the ranks that differ from it along `axis` only)."""
    return [_rank(shape, placement, {**coords, axis: index}) for index in range(shape[axis])]


def crossing_groups(shape: dict[str, int], placement: Sequence[str], axis: str, local: int) -> list[list[int]]:
    """The `axis` groups whose ranks are not all on one node of `local` consecutive ranks (no communication)."""
    if shape[axis] == 1:
        return []
    others = [a for a in DEGREES if a != axis]
    found = []
    for flat in range(math.prod(shape[a] for a in others)):
        coords = {axis: 0}
        for a in others:
            coords[a], flat = flat % shape[a], flat // shape[a]
        members = group_members(shape, placement, coords, axis)
        if len({rank // local for rank in members}) > 1:
            found.append(members)
    return found
