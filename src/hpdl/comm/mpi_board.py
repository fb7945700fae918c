"""The mpi backend's progress board and agreement check: where every rank says which collective it is in, how
the check's vote travels, and the errors that name what each rank called."""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np
import torch

from hpdl.comm import agreement
from hpdl.comm.base import own_op
from hpdl.comm.mpi_base import WAIT, MpiBase
from hpdl.comm.mpi_library import MPI, buffer
from hpdl.comm.progress import OP_CODES, OP_NAMES, ProgressBoard, State, mismatched
from hpdl.comm.work import Work, poll_until
from hpdl.errors import CommError, CommTimeoutError

__all__ = ["Agreement", "WindowBoard"]

VOTE = (torch.int64, "max")
"""The agreement check's vote: a MAX of two int64 (agreement.Ledger.vote)."""


class WindowBoard(ProgressBoard):
    """Progress posted into an MPI window; read with one-sided gets that need no help from the target."""

    def __init__(self, comm: Any, timeout: float):
        self._comm = comm
        self._win = MPI.Win.Allocate(4096, 8, comm=comm)
        self._mine = np.frombuffer(self._win.tomemory(), dtype=np.int64)  # type: ignore[call-overload]
        self._mine[:] = 0
        self.slots = memoryview(self._win.tomemory()).cast("B").cast("q")  # type: ignore[arg-type]
        """The same two words as a memoryview: the fast paths store into it directly (a third of numpy's cost)."""
        self._win.Lock_all()
        # Lock_all may need answers from the other ranks, which only come while they
        # are inside MPI: keep everyone in a (bounded) barrier until all locks are held.
        if not poll_until(comm.Ibarrier().Test, time.perf_counter() + timeout):
            raise CommTimeoutError(
                f"hpdl.init: the {comm.Get_size()} ranks did not all start within {timeout:.0f} s "
                "(a rank failed before hpdl.init, or the launcher started fewer ranks than it announced)"
            )

    @property
    def address(self) -> int:
        """Where this rank's two words are (the compiled fast paths store into them)."""
        return int(self._mine.ctypes.data)

    def post(self, seq: int, op: str) -> None:
        self._mine[0] = seq
        self._mine[1] = OP_CODES.get(op, 0)

    def read(self, timeout: float) -> list[State]:
        """Each rank's two words, read until two reads in a row agree (at most three): a rank posts its number and
        then its op, and a read between the two stores would pair the new number with the old op."""
        deadline = time.perf_counter() + timeout
        states = self._read_once(deadline)
        for _ in range(2):
            again = self._read_once(deadline)
            if again == states:
                break
            states = again
        return states

    def _read_once(self, deadline: float) -> list[State]:
        size = self._comm.Get_size()
        out = np.zeros((size, 2), dtype=np.int64)
        requests = [self._win.Rget(out[r], r) for r in range(size)]
        states: list[State] = []
        for r, request in enumerate(requests):
            if poll_until(request.Test, deadline):
                states.append((int(out[r, 0]), OP_NAMES[int(out[r, 1])] if 0 <= out[r, 1] < len(OP_NAMES) else "?"))
            else:
                states.append(None)
        return states

    def close(self) -> None:
        self._win.Unlock_all()
        self._win.Free()


class Agreement(MpiBase):
    """The agreement check's vote and exchange of rings (agreement.py), on the check's own communicator."""

    def _vote(self, vote: torch.Tensor, seq: int) -> None:
        """The agreement check's 16-byte MAX through the fast path's call, on the check's own communicator (see
        `_check_comm`; an MPI_Iallreduce there every `check_every` collectives: 0.4 us more than the pair's
        messages on 2 ranks, 0.03 us a call)."""
        try:
            request = self._calls.allreduce(
                self._check_handle, vote.data_ptr(), 16, *self._fast_allreduce[VOTE][:2], WAIT
            )
            if request is not None:
                Work(self, "allreduce", seq, request.Test, keep=vote).wait()
        except MPI.Exception as exc:
            raise self._engine_error("allreduce", seq, exc) from exc

    def _vote_gather(self, t: torch.Tensor, seq: int) -> torch.Tensor:
        out = torch.empty(t.numel() * self.size, dtype=t.dtype)
        request = self._check_comm.Iallgather(buffer(t, MPI.BYTE), buffer(out, MPI.BYTE))
        result: torch.Tensor = self._work("allgather", seq, request, lambda: out, t, out).wait()
        return result


def pair_mismatch(owner: Any, op: str, expected: int, received: int, peer: int) -> None:
    """A collective's message of the wrong length (pairs.py): the ranks passed different sizes, or called different
    collectives (the progress board says which: each rank posted what it called under this number)."""
    comm = owner()
    if comm is not None:
        try:
            states: Optional[list[State]] = comm._board().read(min(1.0, comm.timeout))
        except Exception:  # the size's report must not hide behind the board's failure
            states = None
        called = own_op(states, comm.rank, comm._seq, op)
        if mismatched(states, comm.rank, comm._seq, called):
            assert states is not None
            raise comm._mismatch_error(called, comm._seq, states)
    where = f"{op} #{comm._seq} on rank {comm.rank} of {comm.size}" if comm else op
    sent = f"more than {expected} B" if received < 0 else f"{received} B"
    mine = "expected" if op == "broadcast" else "passed"
    raise CommError(
        f"{where}: this rank {mine} {expected} B, rank {peer} sent {sent}: the ranks "
        "passed different sizes to this collective (its result is wrong; the ranks go on, and the agreement check "
        "names both calls at its next check). Every rank must pass the same sizes; run with HPDL_DEBUG=1 to "
        "compare every rank's call before it runs."
    )


def peer_name(src: Optional[int]) -> str:
    return "any rank" if src is None else str(src)


def recv_error(exc: Exception, src: Optional[int], tag: int, t: torch.Tensor) -> CommError:
    return CommError(
        f"recv from {peer_name(src)} (tag {tag}) into {t.numel()} x {agreement.dtype_name(t.dtype)} "
        f"({t.numel() * t.element_size()} B) failed in MPI: {exc}. A message longer than the receiving tensor "
        "is truncated: the sender's tensor must have the receiver's shape and dtype."
    )


def short_message(got: int, src: int, tag: int, t: torch.Tensor) -> CommError:
    nbytes = t.numel() * t.element_size()
    what = "the rest of the tensor would hold stale values" if got < nbytes else "nothing was written into it"
    return CommError(
        f"recv from {src} (tag {tag}): rank {src} sent {got} B, but this rank receives into {t.numel()} x "
        f"{agreement.dtype_name(t.dtype)} ({nbytes} B); {what}. The sender's tensor must have the receiver's "
        "shape and dtype."
    )
