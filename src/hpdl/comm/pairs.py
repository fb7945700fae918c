"""Two-rank communicators: collectives as one message each way instead of MPI's nonblocking collectives; on 4, 8,
16 ... ranks, a small allreduce as recursive doubling over such exchanges.

hpdl needs nonblocking MPI calls (every wait is bounded), and MPICH's
nonblocking collectives cost more than the blocking ones for small messages:
2 ranks, a C loop, 4 B: MPI_Iallreduce 0.91 us, MPI_Allreduce 0.54 us, an
Isend/Irecv pair and a local reduction 0.51 us; 4 KiB: 2.85 / 3.21 / 1.71 us;
MPI_Ibcast 0.80 us against 0.24 us for MPI_Bcast and 0.13 us for one message.
On a communicator of two ranks (the benchmark's, a 2-way mesh dimension, a
pipeline's neighbours) the four collectives below the limits here therefore
travel as one message each way, on a duplicate of the communicator (no user
message can match them), tagged with the collective's number in the pair's
own count, which both ranks keep in step (a message of one collective never
completes another, also where several are in flight and a receive is posted
only after a probe). The reduction is
`MPI_Reduce_local` with the collective's own MPI op; every predefined op is
commutative, so both ranks compute the same bits. A float sum (gradients) is
numpy's vectorised add instead (MPICH's MPI_Reduce_local adds one element at
a time: 84 against 13 us for 1 MiB of float32), one IEEE addition per element
either way: the same bits, also as the compiled module computes them.

On 4, 8, 16 ... ranks an allreduce below MANY_RANKS_BELOW is log2(size) such
exchanges (recursive doubling: the partner at step k is rank ^ 2**k, and
each step reduces what arrived before the next starts). Both partners of a
step combine the same two partial sums, so every rank ends with the same
bits (the order of a float sum is not MPICH's own, within rounding).

A message of the wrong length (ranks that passed different sizes) is an
error on the rank that receives it, where a collective could return with
half of the values untouched (on more than two ranks once its steps are
done: it goes on with its own values, so that no rank waits forever). Open MPI 5.0.11 writes a longer message
than the receive's count past the end of the buffer (its truncation error
comes after the damage: `free(): corrupted unsorted chunks`), so outside
MPICH's family a receive is posted only once a matched probe
(`MPI_Improbe`, `MPI_Imrecv`) has told the length, into a buffer of that
length.

Which calls go this way must be the same on every rank (a rank that sends a
message while its peer waits in a collective would wait forever): every path
(compiled, Python, general) compares the same bytes each way with the same
limits, and HPDL_PAIR_BYTES is one of the settings the ranks compare at
start-up.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
from mpi4py import MPI

from hpdl.comm.env import env_flag, env_number
from hpdl.comm.mpi_calls import finish_briefly, memory_at

__all__ = ["ANY_SIZE", "DEFAULT_BELOW", "KINDS", "Pair", "Pending", "describe", "limits", "probe_first"]

KINDS = ("allreduce", "allgather", "reduce_scatter", "broadcast")

ANY_SIZE = 2**31
"""A limit that every size below the shared-memory path's (and an int count) meets."""

DEFAULT_BELOW = {"allreduce": 32 * 1024, "allgather": ANY_SIZE, "reduce_scatter": ANY_SIZE, "broadcast": ANY_SIZE}
"""Bytes each way (the allreduce's or broadcast's buffer, an allgather's or reduce_scatter's block) below which a
two-rank collective travels as messages. MPICH 5.0.2, 2 ranks, a C loop of nonblocking calls (each way: 4 KiB,
64 KiB, 1 MiB, 16 MiB): allgather 1.97 / 17.4 / 277 / 6006 us as MPI_Iallgather, 1.42 / 5.4 / 102 / 2396 us as
messages; reduce_scatter 3.32 / 27.8 / 389 / 11772 us against 1.75 / 12.3 / 291 / 8416 us (from 128 KiB each
way MPI_Ireduce_scatter_block took 10x); broadcast (one message) 0.38 us at 4 KiB against 0.88 us for
MPI_Ibcast, 11 against 12 us at 1 MiB. allreduce: 1.70 against 3.00 us at 4 KiB, even at 16 KiB, slower from
32 KiB (16.8 against 15.8 us; MPICH's allreduce splits the work there, one exchange each way cannot)."""


def probe_first(library: str) -> bool:
    """Whether the mpi backend's receives (these messages, `recv`) wait for a matched probe: HPDL_PROBE_FIRST (1 or
    0; a rank's own choice, not compared), else every MPI but MPICH and its derivatives (MVAPICH, Intel MPI), whose
    truncation stops at the buffer's end (tested on MPICH 5.0.2; Open MPI 5.0.11 overruns it)."""
    return env_flag("HPDL_PROBE_FIRST", not library.startswith(("MPICH", "MVAPICH", "Intel")))


MANY_RANKS_BELOW = 16 * 1024
"""An allreduce on 4, 8, 16 ... ranks below this many bytes travels as messages (recursive doubling: log2(size)
exchanges, each step's partner rank ^ 2^step). MPICH 5.0.2, 4 ranks on this 2-core VM, a C loop: 5.4 against
14.8 us for MPI_Iallreduce at 4 B, 8.6 against 20.1 at 4 KiB, 38.3 against 39.7 at 16 KiB."""


def limits(size: int) -> dict[str, int]:
    """Per collective, the bytes each way below which it travels as messages on a communicator of `size` ranks:
    two ranks all four collectives, a larger power of two only allreduce, other sizes none. HPDL_PAIR_BYTES sets
    one limit for those (0: never)."""
    none = dict.fromkeys(KINDS, 0)
    if size < 2 or size & (size - 1):
        return none
    chosen = env_number("HPDL_PAIR_BYTES", -1, int, "bytes (0: never)", allow_zero=True)
    if size == 2:
        return dict(DEFAULT_BELOW) if chosen < 0 else dict.fromkeys(KINDS, chosen)
    return dict(none, allreduce=MANY_RANKS_BELOW if chosen < 0 else chosen)


def describe(limits: dict[str, int]) -> str:
    """The limits in words (`hpdl info`, the benchmark's header)."""
    if not any(limits.values()):
        return "none: MPI's collectives"
    return (
        "; ".join(
            f"{op} {'every size' if below >= ANY_SIZE else f'below {below} B' if below else 'never'}"
            for op, below in limits.items()
        )
        + " (each way; at every size the shared-memory engine takes none of an ordinary tensor's, unless measured or"
        " set; under a limit its thresholds come first)"
    )


Mismatch = Callable[[str, int, int, int], None]
"""mismatch(kind, bytes expected, bytes received or -1 for more, the peer that sent them): raises the caller's
error."""


def reduce_local(op: Any, source: Any, target: Any) -> None:
    """`target` (op)= `source`, each [memory, datatype] of one length: a float or double sum through numpy, every
    other op and type MPI's own."""
    memory, datatype = target
    if op == MPI.SUM and (datatype == MPI.FLOAT or datatype == MPI.DOUBLE):
        dtype = np.float32 if datatype == MPI.FLOAT else np.float64
        summed = np.frombuffer(memory, dtype)
        np.add(summed, np.frombuffer(source[0], dtype), out=summed)
    else:
        op.Reduce_local(source, target)


class Pair:
    """The messages through mpi4py (HPDL_COMPILED=0, or no compiled module): the compiled `Pair` in
    _mpi_fast.c has the same calls, on MPI's own handles. Each call starts its messages and returns None
    once they completed within `wait` seconds (negative: not tested), else a `Pending`. `comm` is the pair's
    own (a duplicate): it is freed once the pair and every collective still in flight are gone. `size`: 2, or a
    larger power of two, where only `allreduce` may be called (recursive doubling: log2(size) exchanges)."""

    def __init__(self, comm: Any, rank: int, size: int, tag_span: int, mismatch: Mismatch, probe: bool):
        self._comm = comm
        self._peer = rank ^ 1
        self._rank = rank
        self._steps = max(size.bit_length() - 1, 1)
        self._span = tag_span
        self._mismatch = mismatch
        self._probe = probe
        self._started = 0
        """Collectives started: each one's messages are tagged with its number (every rank counts alike)."""

    def allreduce(self, address: int, nbytes: int, datatype: Any, op: Any, wait: float) -> Any:
        scratch = bytearray(nbytes)
        target = [memory_at(address, nbytes), datatype]

        def reduce() -> None:
            if nbytes:
                reduce_local(op, [scratch, datatype], target)

        return self._exchange("allreduce", [scratch, datatype], target, nbytes, wait, reduce, self._steps)

    def allgather(self, send: int, out: int, nbytes: int, datatype: Any, wait: float) -> Any:
        mine = out + nbytes * self._rank
        theirs = [memory_at(out + nbytes * self._peer, nbytes), datatype]
        copy = bool(send) and send != mine and nbytes > 0
        if not copy or out < send + nbytes and send < out + 2 * nbytes:  # (in place, or overlapping: copy first)
            if copy:
                memory_at(mine, nbytes)[:] = memory_at(send, nbytes)
            return self._exchange("allgather", theirs, [memory_at(mine, nbytes), datatype], nbytes, wait, None)
        # sent from the input itself and copied into place while the message travels, as the compiled Pair does
        pending = self._exchange("allgather", theirs, [memory_at(send, nbytes), datatype], nbytes, -1.0, None)
        memory_at(mine, nbytes)[:] = memory_at(send, nbytes)
        if wait < 0:
            return pending
        return None if pending.wait_briefly(wait) else pending

    def reduce_scatter(self, address: int, out: int, nbytes: int, datatype: Any, op: Any, wait: float) -> Any:
        own = [memory_at(address + nbytes * self._rank, nbytes), datatype]
        target = [memory_at(out, nbytes), datatype]
        send = [memory_at(address + nbytes * self._peer, nbytes), datatype]
        if out + nbytes <= address or out >= address + 2 * nbytes:  # apart: the peer's block arrives in the output

            def reduce_into_output() -> None:
                if nbytes:
                    reduce_local(op, own, target)

            return self._exchange("reduce_scatter", target, send, nbytes, wait, reduce_into_output)
        scratch = [bytearray(nbytes), datatype]

        def reduce() -> None:
            if nbytes:
                target[0][:] = own[0]
                reduce_local(op, scratch, target)

        return self._exchange("reduce_scatter", scratch, send, nbytes, wait, reduce)

    def broadcast(self, address: int, nbytes: int, datatype: Any, root: int, wait: float) -> Any:
        buffer = [memory_at(address, nbytes), datatype]
        if root == self._rank:
            return self._exchange("broadcast", None, buffer, nbytes, wait, None)
        return self._exchange("broadcast", buffer, None, nbytes, wait, None)

    def _exchange(
        self, kind: str, recv: Any, send: Any, nbytes: int, wait: float, reduce: Any, steps: int = 1
    ) -> Any:  # fmt: skip
        tag = self._started % self._span
        self._started += 1
        pending = Pending(self, kind, recv, send, nbytes if recv is not None else -1, reduce, tag, steps)
        if wait < 0:
            return pending
        return None if pending.wait_briefly(wait) else pending

    def __del__(self) -> None:
        if not MPI.Is_finalized():
            self._comm.Free()


class Pending:
    """A pair's collective in flight: `Test()` until True (then the result is in place; a message of the wrong
    length raises through the pair's `mismatch`, once every step has run: every rank finishes the collective)."""

    __slots__ = (
        "_pair", "_kind", "_recv", "_send", "_expected", "_reduce", "_tag", "_steps", "_step", "_peer", "_requests",
        "_probing", "_status", "_received", "_bad", "_done",
    )  # fmt: skip

    def __init__(
        self, pair: Pair, kind: str, recv: Any, send: Any, expected: int, reduce: Any, tag: int, steps: int
    ):  # fmt: skip
        self._pair = pair  # (kept alive: its communicator)
        self._kind = kind
        self._recv = recv
        self._send = send
        self._expected = expected
        self._reduce = reduce
        self._tag = tag
        self._steps = steps
        self._step = 0
        self._peer = pair._peer
        self._status = MPI.Status()
        self._bad: Optional[tuple[int, int]] = None
        """(bytes, peer) of the first message of the wrong length"""
        self._done = False
        self._post()

    def _post(self) -> None:
        """Start this step's messages: the receive (at once, or once its probe matches), then the send."""
        comm = self._pair._comm
        self._received = -2
        self._probing = self._recv is not None and self._pair._probe
        receive = send = MPI.REQUEST_NULL
        if self._recv is not None and not self._probing:
            receive = comm.Irecv(self._recv, self._peer, self._tag)
        if self._send is not None:
            send = comm.Isend(self._send, self._peer, self._tag)
        self._requests = [receive, send]

    def wait_briefly(self, wait: float) -> bool:
        return finish_briefly(self, wait) is None

    def Test(self) -> bool:  # noqa: N802 (the name of mpi4py's Request.Test, which Work calls)
        if self._done:
            return True
        while self._step_done():
            if self._step + 1 == self._steps:
                self._done = True
                if self._bad is None and self._expected >= 0 and self._received != self._expected:
                    self._bad = (self._received, self._peer)
                if self._bad is not None:
                    self._pair._mismatch(self._kind, self._expected, *self._bad)
                if self._reduce is not None:
                    self._reduce()
                return True
            if self._received != self._expected and self._bad is None:  # the steps go on: every rank finishes
                self._bad = (self._received, self._peer)
            elif self._received == self._expected:
                self._reduce()
            self._step += 1
            self._peer = self._pair._rank ^ (1 << self._step)
            self._post()
        return False

    def _step_done(self) -> bool:
        """Whether this step's messages completed (the receive's bytes in `_received`, -1: longer)."""
        if self._probing:
            message = self._pair._comm.Improbe(self._peer, self._tag, self._status)
            if message is None:
                return False
            self._probing = False
            nbytes = self._status.Get_count(MPI.BYTE)
            into = self._recv[0] if nbytes <= self._expected else bytearray(nbytes)  # a longer one: its own buffer
            self._requests[0] = message.Irecv([into, nbytes, MPI.BYTE])
        receive, send = self._requests
        if receive != MPI.REQUEST_NULL:
            try:
                if not receive.Test(self._status):
                    return False
                self._received = self._status.Get_count(MPI.BYTE)
            except MPI.Exception as exc:
                if exc.Get_error_class() != MPI.ERR_TRUNCATE:
                    raise
                self._received = -1
            self._requests[0] = MPI.REQUEST_NULL
        if send != MPI.REQUEST_NULL:
            if not send.Test():
                return False
            self._requests[1] = MPI.REQUEST_NULL
        return True
