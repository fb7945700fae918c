"""`Mesh`: one world split into dp x pp x tp sub-communicators (`build`, in `compose`, applies a plan on it).

    mesh = hpdl.parallel.Mesh(comm, dp=2, pp=2, tp=1)          # -1 infers one degree
    mesh.dp, mesh.pp, mesh.tp                                   # sub-communicators (Communicator)
    model, optimizer = hpdl.parallel.build(model, mesh, plan)   # tp, then pipeline, then dp / ZeRO

Rank placement: the axes are laid out from innermost (consecutive world
ranks) to outermost, by default tp, dp, pp: a tensor-parallel group is a
run of consecutive ranks, which launchers put on one node (tp exchanges
activations in every layer, so it needs the fastest links); pipeline stages
are outermost, across nodes (they exchange one activation per micro-batch).
`placement=("dp", "tp", "pp")` and the like override it. Every rank
calls the constructor (it splits the communicator three times).
"""

from __future__ import annotations

import logging
import math
from typing import Optional, Sequence

from hpdl.comm.base import Communicator
from hpdl.parallel.mesh.plan_config import AXES, Plan, PlanError, resolve_degrees

__all__ = ["Mesh"]

log = logging.getLogger(__name__)


class Mesh:
    """The world as a dp x pp x tp grid; `dp`, `pp`, `tp` are this rank's sub-communicators along each axis.

    `mesh.dp` holds the ranks with this rank's pipeline stage and tp index
    (they hold the same parameters and split the batch); `mesh.pp` the
    ranks with this rank's dp and tp index (one per stage); `mesh.tp` the
    ranks with this rank's dp index and stage (they split each layer).
    """

    def __init__(
        self,
        comm: Communicator,
        *,
        dp: int = -1,
        pp: int = 1,
        tp: int = 1,
        placement: Sequence[str] = AXES,
    ):
        if not isinstance(comm, Communicator):
            raise TypeError(f"Mesh: comm must be an hpdl Communicator (hpdl.init()), got {type(comm).__name__}")
        placement = tuple(placement)
        if sorted(placement) != sorted(AXES):
            raise ValueError(f"Mesh: placement={list(placement)} must order the axes {list(AXES)}, innermost first")
        self.world = comm
        self.placement = placement
        try:
            self.shape: dict[str, int] = resolve_degrees(comm.size, dp, pp, tp)
        except PlanError as exc:
            raise ValueError(f"Mesh: {exc}") from None
        self.coords = self._coordinates(comm.rank)
        subs: dict[str, Communicator] = {}
        for axis in ("dp", "pp", "tp"):  # the same order on every rank: split is collective
            others = [a for a in AXES if a != axis]
            color = self.coords[others[0]] * self.shape[others[1]] + self.coords[others[1]]
            sub = comm.split(color, key=self.coords[axis])
            if sub is None or sub.size != self.shape[axis] or sub.rank != self.coords[axis]:
                raise RuntimeError(f"Mesh: the {axis} split of rank {comm.rank} gave {sub!r}")
            subs[axis] = sub
        self.dp, self.pp, self.tp = subs["dp"], subs["pp"], subs["tp"]
        self._warn_if_tp_crosses_nodes()

    # ------------------------------------------------------------------ coordinates
    def _coordinates(self, rank: int) -> dict[str, int]:
        coords, rest = {}, rank
        for axis in self.placement:  # innermost first: rank = c0 + n0 * (c1 + n1 * c2)
            coords[axis] = rest % self.shape[axis]
            rest //= self.shape[axis]
        return coords

    def coordinates(self, rank: Optional[int] = None) -> dict[str, int]:
        """{"dp": i, "pp": j, "tp": k} of `rank` (default: this rank)."""
        return dict(self.coords) if rank is None else self._coordinates(rank)

    def rank_of(self, *, dp: int, pp: int, tp: int) -> int:
        """The world rank at these coordinates."""
        coords = {"dp": dp, "pp": pp, "tp": tp}
        for axis, value in coords.items():
            if not 0 <= value < self.shape[axis]:
                raise ValueError(f"Mesh.rank_of: {axis}={value} is outside 0..{self.shape[axis] - 1}")
        rank, stride = 0, 1
        for axis in self.placement:
            rank += coords[axis] * stride
            stride *= self.shape[axis]
        return rank

    @property
    def size(self) -> int:
        return self.world.size

    def _warn_if_tp_crosses_nodes(self) -> None:
        local = self.world.local_size
        if self.shape["tp"] == 1 or local <= 1 or local >= self.world.size:
            return
        stride = math.prod(self.shape[a] for a in self.placement[: self.placement.index("tp")])
        span = stride * (self.shape["tp"] - 1) + 1
        if self.placement[0] != "tp" or span > local or local % self.shape["tp"]:
            log.warning(
                "Mesh: tensor-parallel groups of %d ranks (spanning %d consecutive ranks) do not fit in a node of "
                "%d ranks: every layer's allreduce crosses nodes. Put 'tp' first in placement and keep tp <= %d.",
                self.shape["tp"],
                span,
                local,
                local,
            )

    def describe(self) -> str:
        """The grid: degrees, placement and every world rank's coordinates."""
        head = (
            f"Mesh dp={self.shape['dp']} x pp={self.shape['pp']} x tp={self.shape['tp']} = {self.size} ranks "
            f"(innermost first: {', '.join(self.placement)})"
        )
        rows = [
            f"  rank {r}: " + " ".join(f"{a}={c}" for a, c in self._coordinates(r).items()) for r in range(self.size)
        ]
        return "\n".join([head, *rows])

    def __repr__(self) -> str:
        c = self.coords
        return (
            f"Mesh(dp={self.shape['dp']}, pp={self.shape['pp']}, tp={self.shape['tp']}; rank {self.world.rank} at "
            f"dp={c['dp']} pp={c['pp']} tp={c['tp']})"
        )

    @classmethod
    def from_plan(cls, comm: Communicator, plan: Plan) -> Mesh:
        """The mesh of `plan`'s degrees and placement over `comm`."""
        return cls(comm, dp=plan.dp, pp=plan.pp, tp=plan.tp, placement=plan.placement)

    def close(self) -> None:
        """Release the three sub-communicators (the world stays open)."""
        for sub in (self.tp, self.pp, self.dp):
            sub.close()
