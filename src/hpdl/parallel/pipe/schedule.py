"""Pipeline schedules: for each stage, the ordered forward (F) and backward (B) actions on micro-batches.

A schedule is pure data, the same object on every rank: the engine runs a
stage's `actions(stage)` in order, and the receivers post their receives in
the order the senders send, because both read the same lists.

- GPipe (Huang et al., 2019): every stage runs all m forwards, then all m
  backwards (in reverse order, so the last micro-batch, whose activations
  are freshest, goes first). Each stage holds m micro-batches of
  activations at its peak.
- 1F1B (PipeDream-flush; Narayanan et al., 2021): stage s runs
  min(p - s - 1, m) warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards. Stage s never holds more
  than p - s micro-batches, at most p, whatever m is.

Both have the bubble (p - 1) / (m + p - 1) when a backward costs the same
on every stage. `timeline()` lays the actions on a time grid with a cost
per action (forward 1, backward 2 by default) by simulating the
dependencies, and `draw()` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["Action", "Schedule", "GPipe", "OneFOneB", "SCHEDULES", "make_schedule", "bubble_fraction"]


@dataclass(frozen=True)
class Action:
    """One unit of work of a stage: `kind` "F" (forward) or "B" (backward) of micro-batch `microbatch`."""

    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle fraction of a balanced pipeline, (p - 1) / (m + p - 1) (GPipe, section 2.2)."""
    return (stages - 1) / (microbatches + stages - 1)


class Schedule:
    """The actions of every stage of a `stages`-stage pipeline running `microbatches` micro-batches."""

    name = ""

    def __init__(self, stages: int, microbatches: int):
        if not isinstance(stages, int) or stages < 1:
            raise ValueError(f"a schedule needs stages >= 1, got {stages!r}")
        if not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"a schedule needs microbatches >= 1, got {microbatches!r}")
        self.stages = stages
        self.microbatches = microbatches
        self._actions = [self._build(s) for s in range(stages)]

    def _build(self, stage: int) -> list[Action]:
        raise NotImplementedError

    def actions(self, stage: int) -> list[Action]:
        """The actions of `stage`, in the order the stage runs them."""
        return self._actions[stage]

    def peak_live(self, stage: int) -> int:
        """The most micro-batches whose activations `stage` holds at once (forwarded, not yet backwarded)."""
        live = peak = 0
        for action in self._actions[stage]:
            live += 1 if action.kind == "F" else -1
            peak = max(peak, live)
        return peak

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.stages, self.microbatches)

    def timeline(self, forward: int = 1, backward: int = 2) -> list[list[Optional[Action]]]:
        """Per stage, per time slot, the action running there (None: idle), with the given costs in slots.

        F(s, k) starts after F(s-1, k) ends; B(s, k) after B(s+1, k) ends (or
        after F(s, k) on the last stage); each stage runs its actions in order.
        """
        ends: dict[tuple[str, int, int], int] = {}
        cursor = [0] * self.stages
        position = [0] * self.stages
        total = sum(len(a) for a in self._actions)
        done = 0
        while done < total:
            progressed = False
            for s in range(self.stages):
                if position[s] == len(self._actions[s]):
                    continue
                action = self._actions[s][position[s]]
                if action.kind == "F":
                    dep = ("F", s - 1, action.microbatch) if s > 0 else None
                else:
                    dep = ("B", s + 1, action.microbatch) if s < self.stages - 1 else ("F", s, action.microbatch)
                if dep is not None and dep not in ends:
                    continue
                start = max(cursor[s], ends[dep] if dep is not None else 0)
                cursor[s] = ends[(action.kind, s, action.microbatch)] = start + (
                    forward if action.kind == "F" else backward
                )
                position[s] += 1
                done += 1
                progressed = True
            if not progressed:  # pragma: no cover - a schedule bug, not a user error
                raise RuntimeError(f"{self.name} schedule deadlocks at positions {position}")
        length = max(cursor)
        grid: list[list[Optional[Action]]] = [[None] * length for _ in range(self.stages)]
        for (kind, s, k), end in ends.items():
            cost = forward if kind == "F" else backward
            for t in range(end - cost, end):
                grid[s][t] = Action(kind, k)
        return grid

    def draw(self, forward: int = 1, backward: int = 2) -> str:
        """The timeline as text: one row per stage, one column per time slot ('.' is idle)."""
        grid = self.timeline(forward, backward)
        width = max(len(str(Action("F", self.microbatches - 1))), 2)
        lines = [
            f"{self.name}: {self.stages} stages, {self.microbatches} micro-batches "
            f"(F = forward, B = backward {backward}x as long; . = idle; bubble (p-1)/(m+p-1) = {self.bubble:.3f})"
        ]
        for s, row in enumerate(grid):
            cells = [(str(a) if a is not None else ".").ljust(width) for a in row]
            lines.append(f"stage {s}: " + " ".join(cells).rstrip())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(stages={self.stages}, microbatches={self.microbatches})"


class GPipe(Schedule):
    """All forwards, then all backwards (last micro-batch first)."""

    name = "gpipe"

    def _build(self, stage: int) -> list[Action]:
        m = self.microbatches
        return [Action("F", k) for k in range(m)] + [Action("B", k) for k in reversed(range(m))]


class OneFOneB(Schedule):
    """Warm-up forwards, then one forward one backward, then the remaining backwards (PipeDream-flush)."""

    name = "1f1b"

    def _build(self, stage: int) -> list[Action]:
        m = self.microbatches
        warmup = min(self.stages - stage - 1, m)
        out = [Action("F", k) for k in range(warmup)]
        forward, backward = warmup, 0
        while forward < m:
            out.append(Action("F", forward))
            forward += 1
            out.append(Action("B", backward))
            backward += 1
        out += [Action("B", k) for k in range(backward, m)]
        return out


SCHEDULES: dict[str, type[Schedule]] = {"gpipe": GPipe, "1f1b": OneFOneB}


def make_schedule(name: str, stages: int, microbatches: int) -> Schedule:
    """The schedule called `name` ("gpipe" or "1f1b")."""
    try:
        cls = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"schedule={name!r} is not known; choose one of {sorted(SCHEDULES)}") from None
    return cls(stages, microbatches)
