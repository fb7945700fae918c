"""Who has arrived: the bookkeeping behind timeout errors that name the missing ranks.

Each rank posts the number and name of the collective it is entering (cheap:
a store into memory for MPI). When a wait times out, the rank reads every
other rank's last post and reports the ranks that are behind it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

__all__: list[str] = []

OP_NAMES = (
    "",
    "allreduce",
    "allgather",
    "reduce_scatter",
    "broadcast",
    "alltoall",
    "barrier",
    "split",
    "allreduce_coalesced",
    "finalize",
    "left",  # closed without the exit barrier after an error broke the communicator (posted at that collective)
)
OP_CODES = {name: code for code, name in enumerate(OP_NAMES)}

State = Optional[tuple[int, str]]
"""(sequence number, op name) of a rank's last collective; None when the rank did not answer."""


class ProgressBoard(ABC):
    @abstractmethod
    def post(self, seq: int, op: str) -> None:
        """Publish that this rank entered collective number `seq`."""

    @abstractmethod
    def read(self, timeout: float) -> list[State]:
        """Every rank's last post, waiting at most `timeout` seconds in total."""

    def close(self) -> None:  # noqa: B027 - a no-op by default: most boards hold nothing
        """Release engine resources (collective where the engine needs it)."""


class LocalBoard(ProgressBoard):
    """A one-rank board: nobody else can be missing."""

    def __init__(self) -> None:
        self.state: tuple[int, str] = (0, "")

    def post(self, seq: int, op: str) -> None:
        self.state = (seq, op)

    def read(self, timeout: float) -> list[State]:
        return [self.state]


def describe_laggards(states: Optional[list[State]], rank: int, seq: int) -> tuple[str, list[int]]:
    """A sentence naming the ranks that did not reach collective `seq`, and their ranks."""
    if states is None:
        return "The other ranks' progress could not be read.", []
    behind, silent, ahead = [], [], []
    for other, state in enumerate(states):
        if other == rank:
            continue
        if state is None:
            silent.append(other)
        elif state[0] < seq:
            behind.append(f"rank {other} (last entered #{state[0]} {state[1] or '(none)'})")
        elif state[0] > seq:
            ahead.append(f"rank {other} (already at #{state[0]} {state[1]})")
    missing = [int(text.split()[1]) for text in behind] + silent
    parts = []
    if behind:
        parts.append("Did not arrive: " + ", ".join(behind) + ".")
    if silent:
        names = ("rank " if len(silent) == 1 else "ranks ") + ", ".join(map(str, silent))
        parts.append(f"Did not arrive: {names} (no progress report: busy outside hpdl, or gone).")
    if ahead:
        parts.append("Ahead of this rank: " + ", ".join(ahead) + " (this rank may have skipped a collective).")
    if not parts:
        parts.append("Every rank reached this collective; the engine itself did not complete it.")
    return " ".join(parts), missing
