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


def describe_laggards(
    states: Optional[list[State]], rank: int, seq: int, op: str = "", hosts: Optional[list[str]] = None
) -> tuple[str, list[int]]:
    """Where every rank is, and what that says, for a wait in collective `seq` (`op`) that did not complete: a
    sentence, and the ranks that did not arrive at it. Only collectives the ranks' users called are named (the
    board holds nothing else), and "every rank reached this collective" only where every rank is in the same op
    under the same number. With `hosts` (each rank's host name), silent ranks are named with their hosts: a whole
    host gone silent is a lost host, not a wrong call."""
    if states is None:
        return "The other ranks' progress could not be read.", []
    states = list(states)
    own = states[rank]
    if not op and own is not None and own[0] == seq:  # (the caller did not say: its own post does)
        op = own[1]
    states[rank] = (seq, op)
    behind, silent, ahead, differ = [], [], [], []
    for other, state in enumerate(states):
        if other == rank:
            continue
        if state is None:
            silent.append(other)
        elif state[0] < seq:
            behind.append(other)
        elif state[0] > seq:
            ahead.append(other)
        elif state[1] not in (op, "left", "finalize"):  # a rank that left or finished called nothing else
            differ.append(other)
    parts = [positions(states) + ("." if not differ else f": {different_collectives(seq)}.")]
    if behind:
        parts.append(f"Did not arrive: {_ranks(behind)} (still in an earlier collective, or busy outside hpdl).")
    if silent:
        parts.append(f"Did not arrive: {_ranks(silent)}{_on_hosts(silent, hosts)} ({_SILENT}).")
    if ahead and not (behind or silent or differ):
        parts.append(
            f"{_ranks(ahead).capitalize()} went past #{seq} without this rank: the ranks called different "
            f"collectives, or different numbers of them, at or before #{seq}."
        )
    if not (behind or silent or ahead or differ):
        parts.append("Every rank reached this collective; the engine itself did not complete it.")
    return " ".join(parts), behind + silent


_SILENT = "no progress report: their host is unreachable, or their processes are gone or busy outside hpdl"


def lost_hosts(states: Optional[list[State]], missing: list[int], rank: int, hosts: Optional[list[str]]) -> bool:
    """Whether every rank that did not arrive is on another host than `rank` and sent no progress report at all:
    a host lost (its link, its processes), not a rank that is late or called something else."""
    if states is None or not missing or not hosts:
        return False
    return all(states[r] is None and hosts[r] != hosts[rank] for r in missing)


def _on_hosts(ranks: list[int], hosts: Optional[list[str]]) -> str:
    """' on host b' (' on hosts b, c'): where `ranks` run, when the hosts are known and not this one alone."""
    if not hosts or len(set(hosts)) == 1:
        return ""
    names = sorted({hosts[r] for r in ranks})
    return f" on host{'s' if len(names) > 1 else ''} {', '.join(names)}"


def mismatched(states: Optional[list[State]], rank: int, seq: int, op: str) -> list[int]:
    """The ranks whose post says they called a different collective than `op` as their #`seq`: proof of a mismatch,
    whenever it was posted (a rank posts each number once, with the op it called). "finalize" and "left" are the
    callers' own business (a rank that finished is not a different collective)."""
    if states is None:
        return []
    return [
        other
        for other, state in enumerate(states)
        if other != rank and state is not None and state[0] == seq and state[1] not in (op, "", "finalize", "left")
    ]


def different_collectives(seq: int) -> str:
    return f"the ranks called different collectives as their collective #{seq}"


def positions(states: list[State]) -> str:
    """Where each rank is, ranks in the same place together: `rank 0 is in allreduce #3; rank 1 is in barrier #3`."""
    places: dict[State, list[int]] = {}
    for other, state in enumerate(states):
        places.setdefault(state, []).append(other)
    said = []
    for state, ranks in places.items():
        who = _ranks(ranks)
        verb = "is" if len(ranks) == 1 else "are"
        if state is None:
            said.append(f"{who} gave no progress report")
        elif not state[1]:
            said.append(f"{who} {'has' if len(ranks) == 1 else 'have'} called no collective yet")
        elif state[1] == "left":
            said.append(f"{who} left after an error in #{state[0]}")
        else:
            said.append(f"{who} {verb} in {state[1]} #{state[0]}")
    return "; ".join(said)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
