"""Debug mode: ranks compare what they are about to call before they call it.

A mismatched collective (different op, shape, dtype, root or reduce op, or a
different number of earlier collectives) would otherwise hang or corrupt
data. With `debug` on, every collective first allgathers a small fixed-size
fingerprint; any difference raises `CollectiveMismatchError` on every rank,
naming both ranks and both call sites.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from hpdl.comm.work import Work
from hpdl.errors import CollectiveMismatchError

__all__: list[str] = []


class _Engine(Protocol):
    """What `verify` needs of a communicator (`hpdl.comm.base.Communicator` imports this module)."""

    backend: str

    @property
    def size(self) -> int: ...

    def _allgather(self, t: torch.Tensor, sizes: list[int], seq: int, out: Optional[torch.Tensor] = None) -> Work: ...


_WIDTH = 512
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Fingerprint:
    rank: int
    seq: int
    op: str
    shape: str
    dtype: str
    detail: str
    site: str

    def key(self) -> tuple:
        """What must agree across ranks (the call site may legitimately differ)."""
        return (self.seq, self.op, self.shape, self.dtype, self.detail)

    def describe(self) -> str:
        args = ", ".join(x for x in (f"shape={self.shape}" if self.shape else "", self.dtype, self.detail) if x)
        return f"rank {self.rank} called {self.op}({args}) as collective #{self.seq} at {self.site}"

    def encode(self) -> torch.Tensor:
        text = "\x1f".join([str(self.rank), str(self.seq), self.op, self.shape, self.dtype, self.detail, self.site])
        data = text.encode()[:_WIDTH].ljust(_WIDTH, b"\0")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    @staticmethod
    def decode(row: torch.Tensor) -> Fingerprint:
        fields = row.numpy().tobytes().rstrip(b"\0").decode(errors="replace").split("\x1f")
        fields += [""] * (7 - len(fields))
        return Fingerprint(int(fields[0]), int(fields[1]), *fields[2:7])


def call_site() -> str:
    """The first frame outside hpdl: where the user's code called the collective."""
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def verify(comm: _Engine, mine: Fingerprint) -> None:
    """Allgather fingerprints (through the engine directly) and raise on any difference."""
    table = comm._allgather(mine.encode(), [_WIDTH] * comm.size, mine.seq).wait()
    prints = [Fingerprint.decode(table[i * _WIDTH : (i + 1) * _WIDTH]) for i in range(comm.size)]
    groups: dict[tuple, list[Fingerprint]] = {}
    for other in prints:
        groups.setdefault(other.key(), []).append(other)
    if len(groups) > 1:
        calls = "; but ".join(_describe_group(members) for members in groups.values())
        raise CollectiveMismatchError(
            f"collective mismatch between ranks of a {comm.size}-rank {comm.backend} communicator: {calls}. "
            "Every rank must call the same collectives, with the same shapes, dtypes and arguments, in the same order."
        )


def _describe_group(members: list[Fingerprint]) -> str:
    """'rank 0 called ...' for one rank, 'ranks 1, 2 called ... (rank 1) at ...' for several."""
    first = members[0]
    if len(members) == 1:
        return first.describe()
    names = ", ".join(str(m.rank) for m in members)
    return f"ranks {names} called" + first.describe().split(" called", 1)[1]
