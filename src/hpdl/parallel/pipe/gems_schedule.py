"""The GEMS-MASTER schedule: two replicas of one pipeline on the same ranks, stages in opposite order.

GEMS (Jain et al., SC20) adds a second replica of a model-parallel pipeline
in the memory and compute the first leaves idle; GEMS-MASTER places that
replica's stages in reverse order, so rank r holds stage r of replica A and
stage p-1-r of replica B. Replica A's micro-batches enter at rank 0 while
replica B's enter at rank p-1: each replica's forwards run while the other
one is in its warm-up or drain bubble.

Each replica gets half of the m micro-batches (A: ceil(m/2), B:
floor(m/2)). A rank merges its two replicas' work by list scheduling on a
time grid (forward 1 slot, backward 2): it runs, among the actions whose
inputs are there, the one that can start first, the oldest micro-batch
first; each replica's stage s holds at most p - s of its micro-batches
(1F1B's bound). The result is pure data, the same on every rank; the
engine runs exactly these lists.

Counted on the grid (balanced stages): on 2 ranks with an even m the bubble
is 0 (one 1F1B pipeline: 1/(m+1)) and each rank holds at most 2
micro-batches (1F1B's stage 0: 2); on p ranks a rank holds at most
min(m, p + 1) (both replicas together; `gems_peak_bound`). For p > 2 the
bubble has no closed form here: `gems_bubble(p, m)` counts it on the grid
(e.g. 4 ranks, 8 micro-batches: 0.172 against 1F1B's 0.273), and
`hpdl.plan` uses that function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hpdl.parallel.pipe.schedule import Action, Schedule, bubble_fraction

__all__ = ["GemsAction", "GemsSchedule", "gems_bubble", "gems_peak_bound", "REPLICA_NAMES"]

REPLICA_NAMES = ("A", "B")
FORWARD_SLOTS, BACKWARD_SLOTS = 1, 2
RULES = ("oldest", "unblock")
"""Tie-breaks of the list scheduling; the schedule keeps the shorter grid."""


@dataclass(frozen=True)
class GemsAction(Action):
    """An action of one replica: replica 0 (A, stage = rank) or 1 (B, stage = p - 1 - rank)."""

    replica: int = 0

    def __str__(self) -> str:  # replica A upper case, replica B lower case: F3 / f3
        text = f"{self.kind}{self.microbatch}"
        return text if self.replica == 0 else text.lower()


class GemsSchedule(Schedule):
    """Per rank, the merged actions of replica A (stage = rank) and replica B (stage = p - 1 - rank)."""

    name = "gems"

    def __init__(self, stages: int, microbatches: int):
        if not isinstance(microbatches, int) or microbatches < 2:
            raise ValueError(
                f"the gems schedule needs at least 2 micro-batches (one per replica), got {microbatches!r}"
            )
        self.split = ((microbatches + 1) // 2, microbatches // 2)
        """Micro-batches of replica A and of replica B."""
        self.stages = stages
        self.microbatches = microbatches
        self._actions, self._ends = self._best(FORWARD_SLOTS, BACKWARD_SLOTS)

    def stage_of(self, replica: int, rank: int) -> int:
        """The stage of `replica` that `rank` holds."""
        return rank if replica == 0 else self.stages - 1 - rank

    def rank_of(self, replica: int, stage: int) -> int:
        return stage if replica == 0 else self.stages - 1 - stage

    # ------------------------------------------------------------------ list scheduling
    def _best(self, forward: int, backward: int) -> tuple[list[list[Action]], dict]:
        """The shorter of two list schedules (ties: the first), so the grid is never longer than needed."""
        options = [self._merge(forward, backward, rule) for rule in RULES]
        return min(options, key=lambda option: max(option[1].values()))

    def _merge(self, forward: int, backward: int, rule: str = "oldest") -> tuple[list[list[Action]], dict]:
        """Each rank's merged order, by simulating the dependencies on a time grid; and every action's end slot.

        A rank runs, among the actions whose inputs are there, the one that can
        start first; ties go (rule "oldest") to the oldest micro-batch, then a
        backward, then replica A, or (rule "unblock") first to an action whose
        output another rank waits for, then a forward. Forwards and backwards
        of one replica's stage each keep micro-batch order, and a stage s
        starts a forward only while it holds fewer than p - s micro-batches of
        that replica (1F1B's bound).
        """
        p = self.stages
        forwards = [[0, 0] for _ in range(p)]  # per rank, per replica: next forward / backward micro-batch
        backwards = [[0, 0] for _ in range(p)]
        cursor = [0] * p
        ends: dict[tuple[int, str, int, int], int] = {}  # (replica, kind, stage, microbatch) -> end slot
        orders: list[list[Action]] = [[] for _ in range(p)]
        total = 2 * p * self.microbatches
        while len(ends) < total:
            best: Optional[tuple] = None  # (start, tie-break..., replica, rank, kind)
            for rank in range(p):
                for replica in (0, 1):
                    stage, n = self.stage_of(replica, rank), self.split[replica]
                    f, b = forwards[rank][replica], backwards[rank][replica]
                    candidates = []
                    if f < n and f - b < p - stage:
                        candidates.append(("F", f))
                    if b < f:
                        candidates.append(("B", b))
                    for kind, k in candidates:
                        dep = self._dependency(replica, stage, Action(kind, k))
                        if dep is not None and dep not in ends:
                            continue
                        start = max(cursor[rank], ends[dep] if dep is not None else 0)
                        if rule == "oldest":
                            order = (k, int(kind == "F"))
                        else:
                            feeds = (kind == "F" and stage < p - 1) or (kind == "B" and stage > 0)
                            order = (int(not feeds), int(kind == "B"))
                        key = (start, *order, replica, rank, kind)
                        if best is None or key < best:
                            best = key
            if best is None:  # pragma: no cover - a schedule bug, not a user error
                raise RuntimeError(f"gems schedule deadlocks at forwards {forwards}, backwards {backwards}")
            start, replica, rank, kind = best[0], best[-3], best[-2], best[-1]
            k = forwards[rank][replica] if kind == "F" else backwards[rank][replica]
            (forwards if kind == "F" else backwards)[rank][replica] += 1
            cost = forward if kind == "F" else backward
            cursor[rank] = ends[(replica, kind, self.stage_of(replica, rank), k)] = start + cost
            orders[rank].append(GemsAction(kind, k, replica))
        return orders, ends

    def replica_actions(self, replica: int, rank: int) -> list[Action]:
        """The actions that `rank` runs for `replica` (its stage `stage_of(replica, rank)`), in their order."""
        return [Action(a.kind, a.microbatch) for a in self._actions[rank] if getattr(a, "replica", 0) == replica]

    def _dependency(self, replica: int, stage: int, action: Action) -> Optional[tuple[int, str, int, int]]:
        k = action.microbatch
        if action.kind == "F":
            return (replica, "F", stage - 1, k) if stage > 0 else None
        return (replica, "B", stage + 1, k) if stage < self.stages - 1 else (replica, "F", stage, k)

    # ------------------------------------------------------------------ what the grid shows
    def timeline(self, forward: int = FORWARD_SLOTS, backward: int = BACKWARD_SLOTS) -> list[list[Optional[Action]]]:
        """Per rank, per time slot, the action running there (None: idle)."""
        same = (forward, backward) == (FORWARD_SLOTS, BACKWARD_SLOTS)
        ends = self._ends if same else self._best(forward, backward)[1]
        length = max(ends.values())
        grid: list[list[Optional[Action]]] = [[None] * length for _ in range(self.stages)]
        for (replica, kind, stage, k), end in ends.items():
            cost = forward if kind == "F" else backward
            rank = self.rank_of(replica, stage)
            for t in range(end - cost, end):
                grid[rank][t] = GemsAction(kind, k, replica)
        return grid

    @property
    def bubble(self) -> float:
        """The idle fraction of the time grid (forward 1 slot, backward 2), counted slot by slot."""
        grid = self.timeline()
        idle = sum(cell is None for row in grid for cell in row)
        return idle / (len(grid) * len(grid[0]))

    def draw(self, forward: int = FORWARD_SLOTS, backward: int = BACKWARD_SLOTS) -> str:
        grid = self.timeline(forward, backward)
        width = max(len(str(Action("F", self.microbatches - 1))), 2)
        ref = bubble_fraction(self.stages, self.microbatches)
        lines = [
            f"gems: {self.stages} ranks, {self.microbatches} micro-batches "
            f"(A: {self.split[0]}, stage = rank, upper case; B: {self.split[1]}, stage = p-1-rank, lower case; "
            f"F/f forward, B/b backward {backward}x as long; . idle; bubble {self.bubble:.3f}, "
            f"one 1f1b pipeline: {ref:.3f})"
        ]
        for rank, row in enumerate(grid):
            cells = [(str(a) if a is not None else ".").ljust(width) for a in row]
            lines.append(f"rank {rank}: " + " ".join(cells).rstrip())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"GemsSchedule(stages={self.stages}, microbatches={self.microbatches})"


def gems_bubble(stages: int, microbatches: int) -> float:
    """The idle fraction of the gems schedule on balanced stages (forward 1 slot, backward 2), counted on the grid."""
    if stages == 1:
        return 0.0
    return GemsSchedule(stages, microbatches).bubble


def gems_peak_bound(stages: int, microbatches: int) -> int:
    """The most micro-batches a rank holds at once, both replicas together: 2 on 2 ranks, else min(m, p + 1)."""
    return min(microbatches, 2 if stages <= 2 else stages + 1)
