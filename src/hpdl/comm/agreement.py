"""The agreement check: ranks that disagree on a collective's size, dtype or op are caught with debug off.

MPI does not compare what the ranks pass: an `allreduce` of 1,000 floats on
one rank and 2,000 on another returns normally on both, with half of the
second rank's values untouched. Debug mode compares a full fingerprint
before every call (one extra allgather each); this check costs almost
nothing instead:

- every collective stores a one-int description of itself (a CRC of the
  operation, dtype and reduce op or root; its bytes; the total dim 0 of an
  allgather) into slot `seq % every` of a ring;
- every `every` collectives (at the same sequence number on every rank), at
  every `barrier` and at `finalize`, the ranks hash their rings and
  allreduce `(hash, -hash)` with MAX, 16 bytes: equal hashes give
  `max == -min`;
- when they differ, the ranks exchange their rings and raise
  `CollectiveMismatchError` on every rank, naming the first collective on
  which they disagree, each rank's call and bytes.

The vote and the exchange go through the communicator's `_vote` and
`_vote_gather`, which on mpi meet on a communicator of their own: a rank in
the check never takes a peer's user collective for its vote (the ranks wait,
and the progress board names what each called: base.Communicator._check_peers).

A mismatch is therefore reported before the data of the collective that
completes the `every`-th call moves, and the wrong values of at most
`every - 1` earlier calls can have reached the caller. `every=1` checks
before each call; 0 switches the check off.
"""

from __future__ import annotations

import zlib
from typing import Protocol

import numpy as np
import torch

from hpdl.comm.env import env_number
from hpdl.errors import CollectiveMismatchError


class Agreeing(Protocol):
    """What the checks need of a communicator: `hpdl.comm.base.Communicator`, which imports this module."""

    rank: int
    size: int
    backend: str
    _ledger: Ledger

    def _vote(self, vote: torch.Tensor, seq: int) -> None: ...

    def _vote_gather(self, t: torch.Tensor, seq: int) -> torch.Tensor: ...


__all__: list[str] = []

DEFAULT_EVERY = 16
"""Collectives between two agreement checks on the mpi backend (HPDL_CHECK_EVERY; 0: off)."""
MASK = (1 << 62) - 1
_MULTIPLIER = 1_000_003
_LINE = 96  # bytes per call in the exchanged ring


_CODES: dict[tuple[str, str, str], int] = {}
_NAMES: dict[int, str] = {}


def default_every(backend: str) -> int:
    """The check's period: HPDL_CHECK_EVERY, else 16 on mpi (gloo and self compare sizes themselves)."""
    fallback = DEFAULT_EVERY if backend == "mpi" else 0
    return env_number("HPDL_CHECK_EVERY", fallback, int, "a number of collectives (0: off)", allow_zero=True)


def code(op: str, dtype: str, detail: str) -> int:
    """A number that names (op, dtype, detail) identically on every rank (cached: it runs per call)."""
    key = (op, dtype, detail)
    found = _CODES.get(key)
    if found is None:
        found = _CODES[key] = zlib.crc32(f"{op}|{dtype}|{detail}".encode())
        _NAMES[found] = f"{op}({', '.join(x for x in (dtype, detail) if x)})"
    return found


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def entry(code: int, nbytes: int, extra: int = 0) -> int:
    """One collective as one int, decoded by `describe`: the one Python encoding (every path calls it; the compiled
    fast paths' is `entry_of` in _mpi_fast.c, and tests/test_compiled.py checks that the two agree)."""
    return code | nbytes << 32 | (extra + 1) << 80


def describe(item: int) -> str:
    name = _NAMES.get(item & 0xFFFFFFFF, f"code {item & 0xFFFFFFFF:08x}")
    nbytes, extra = (item >> 32) & (1 << 48) - 1, (item >> 80) - 1
    if name.startswith("allgather"):  # ranks may pass different dim 0: rows and the total are compared
        return f"{name} with rows of {nbytes} B, {extra if extra >= 0 else 'exchanged'} rows in all"
    return f"{name} on {nbytes} B" + (f" (extra {extra})" if extra > 0 else "")


class Ledger:
    """One communicator's ring of its last `every` calls (slot: sequence number modulo `every`).

    Each call only stores one int in its slot; the signature is computed
    when the ranks compare (every `every` calls, each slot then holds one of
    the calls since the previous check).
    """

    __slots__ = ("every", "ring", "_vote", "_values")

    def __init__(self, every: int):
        if every < 0:
            raise ValueError(f"check_every={every} must be >= 0 (0 switches the agreement check off)")
        self.every = every
        self.ring: list[int] = [0] * max(every, 1)
        self._vote = torch.zeros(2, dtype=torch.int64)
        self._values = memoryview(self._vote.numpy()).cast("B").cast("q")  # type: ignore[arg-type]
        """The vote's two words: a memoryview reads and stores Python ints several times faster than numpy."""

    def vote(self) -> torch.Tensor:
        """The 16 bytes the ranks MAX-reduce: (signature, -signature) of the ring."""
        signature = hash(tuple(self.ring)) & MASK
        values = self._values
        values[0] = signature
        values[1] = -signature
        return self._vote

    def clear(self) -> None:
        self.ring[:] = [0] * len(self.ring)  # in place: communicators hold the list itself

    def agreed(self) -> bool:
        """Whether the ranks' signatures were equal (after the MAX allreduce of `vote`)."""
        values = self._values
        return values[0] == -values[1]

    def lines(self, seq: int) -> bytes:
        """This rank's ring as fixed-width text lines, oldest first (for the error message)."""
        every = len(self.ring)
        out = bytearray()
        for number in range(max(seq - every + 1, 1), seq + 1):
            item = self.ring[number % every]
            if item:
                out += f"{number}\x1f{describe(item)}".encode()[:_LINE].ljust(_LINE, b"\0")
        return bytes(out)


def check(comm: Agreeing, seq: int) -> None:
    """Compare signatures across ranks (one 16-byte allreduce); raise on every rank when they differ."""
    ledger = comm._ledger
    vote = ledger.vote()
    comm._vote(vote, seq)
    error = None if ledger.agreed() else mismatch_error(comm, seq)
    ledger.clear()  # every rank compared these calls: a later check looks only at newer ones
    if error is not None:
        raise error


def mismatch_error(comm: Agreeing, seq: int) -> CollectiveMismatchError:
    """Exchange the rings (two small allgathers) and describe the first collective the ranks disagree on."""
    ledger = comm._ledger
    width = _LINE * len(ledger.ring)
    mine = np.frombuffer(ledger.lines(seq).ljust(width, b"\0"), dtype=np.uint8).copy()
    table = comm._vote_gather(torch.from_numpy(mine), seq).numpy().tobytes()
    rings: list[dict[int, str]] = []
    for rank in range(comm.size):
        block = table[rank * width : (rank + 1) * width]
        calls: dict[int, str] = {}
        for start in range(0, width, _LINE):
            line = block[start : start + _LINE].rstrip(b"\0").decode(errors="replace")
            if line:
                number, _, text = line.partition("\x1f")
                calls[int(number)] = text
        rings.append(calls)
    numbers = sorted({n for ring in rings for n in ring})
    first = next((n for n in numbers if len({ring.get(n, "(nothing)") for ring in rings}) > 1), None)
    if first is None:
        where = "the ranks' calls look alike but their arguments differ (for example allgather sizes)"
    else:
        groups: dict[str, list[int]] = {}
        for rank, ring in enumerate(rings):
            groups.setdefault(ring.get(first, "(no collective)"), []).append(rank)
        described = "; ".join(
            f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} called {text}"
            for text, ranks in groups.items()
        )
        where = f"collective #{first}: {described}"
    every = ledger.every
    return CollectiveMismatchError(
        f"collective mismatch between ranks of a {comm.size}-rank {comm.backend} communicator, found by the "
        f"agreement check at collective #{seq} (it runs every {every} collectives, at barrier and at finalize): "
        f"{where}. The results of the collectives since the previous check may be wrong on every rank. Every rank "
        "must call the same collectives with the same sizes, dtypes and ops in the same order; run with "
        "HPDL_DEBUG=1 to compare call sites before every call."
    )
