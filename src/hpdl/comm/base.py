"""The one interface every strategy uses: collectives and point-to-point on tensors.

`Communicator` checks arguments, numbers each collective, runs the debug
fingerprint check and keeps the bookkeeping for timeout errors; a backend
(`mpi`, `torch`, `self`) implements the engine calls (the `_`-prefixed
methods), each returning a `Work` handle.
"""

from __future__ import annotations

import math
import pickle
import sys
import time
import zlib
from abc import ABC, abstractmethod
from typing import Any, Optional, Sequence

import torch

from hpdl.comm import agreement, fingerprint, fusion
from hpdl.comm.env import env_flag, env_number
from hpdl.comm.progress import (
    ProgressBoard,
    State,
    describe_laggards,
    different_collectives,
    lost_hosts,
    mismatched,
    positions,
)
from hpdl.comm.tensors import (
    ArrayLike,
    as_tensor,
    check_contiguous,
    check_divisible,
    check_peer,
    check_reduce_op,
    check_root,
    check_same_device_dtype,
    like_input,
)
from hpdl.comm.trace import Tracer
from hpdl.comm.work import Work, chain
from hpdl.errors import CollectiveMismatchError, CommError, CommTimeoutError, NotInitializedError

__all__ = ["Communicator", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 300.0
"""Seconds any single wait may take before it becomes a `CommTimeoutError` (HPDL_TIMEOUT overrides)."""
EXIT_BARRIER_SECONDS = 30.0
"""At most this long, `finalize` waits for the other ranks before closing the engine."""

DECLINED = object()
"""`start_briefly`'s answer when the engine has no such call for these arguments (nothing was started)."""


def default_timeout() -> float:
    return env_number("HPDL_TIMEOUT", DEFAULT_TIMEOUT, float, "a number of seconds")


def default_debug() -> bool:
    return env_flag("HPDL_DEBUG")


class Communicator(ABC):
    """A group of ranks that run collectives together.

    Attributes: `rank`, `size`, `local_rank`, `local_size` (ranks on this
    node), `backend` ("mpi", "torch" or "self"), `timeout` (seconds per wait)
    and `debug` (compare collective fingerprints before each call; set it to
    the same value on every rank).
    """

    backend: str = ""

    def __init__(self, *, rank: int, size: int, local_rank: int, local_size: int, timeout: float, debug: bool):
        self.rank = rank
        self.size = size
        self.local_rank = local_rank
        self.local_size = local_size
        self.hosts: Optional[list[str]] = None
        """Each rank's host name, where the job learned them (hpdl.init's world): timeout errors name lost hosts."""
        self.timeout = timeout
        self._debug = bool(debug)
        self._tracer: Optional[Tracer] = None
        self._closed = False
        self._plain = True
        """Neither debug nor tracing nor closed: the backends' fast paths apply (kept by the setters)."""
        self._refresh()
        self._seq = 0
        self.check_every = agreement.default_every(self.backend)
        self._finalize_error: Optional[CommError] = None
        self._broken = False
        self._finalizing = False
        self._children: list[Communicator] = []
        self._packer = fusion.Packer()

    # ------------------------------------------------------------------ settings read on every call
    @property
    def debug(self) -> bool:
        """Compare full fingerprints (with call sites) before each collective; the same value on every rank."""
        return self._debug

    @debug.setter
    def debug(self, value: bool) -> None:
        self._debug = bool(value)
        self._refresh()

    @property
    def tracer(self) -> Optional[Tracer]:
        """A `Tracer` that records every operation, or None."""
        return self._tracer

    @tracer.setter
    def tracer(self, value: Optional[Tracer]) -> None:
        self._tracer = value
        self._refresh()

    @property
    def check_every(self) -> int:
        """Collectives between two agreement checks (see agreement.py; 0: off); the same value on every rank."""
        return self._ledger.every

    @check_every.setter
    def check_every(self, value: int) -> None:
        self._ledger = agreement.Ledger(int(value))
        self._every = self._ledger.every
        self._ring = self._ledger.ring

    def _refresh(self) -> None:
        self._plain = not (self._debug or self._tracer is not None or self._closed)

    # ------------------------------------------------------------------ collectives
    def allreduce(self, tensor: ArrayLike, op: str = "sum", *, async_op: bool = False) -> Any:
        """Reduce `tensor` across ranks in place and return it (ops: sum, avg, max, min, prod)."""
        t = self._tensor_arg(tensor, "allreduce")
        check_reduce_op(op, t.dtype, "allreduce")
        seq = self._begin("allreduce", t, f"op={op}")
        work = self._allreduce(t, op, seq)
        if async_op:
            return work.returns(tensor)
        work.wait()
        return tensor

    def allgather(
        self,
        tensor: ArrayLike,
        *,
        sizes: Optional[Sequence[int]] = None,
        out: Optional[ArrayLike] = None,
        async_op: bool = False,
    ) -> Any:
        """Concatenate every rank's tensor along dim 0 into a new tensor (dim-0 sizes may differ).

        `sizes` (every rank's dim-0 size, the same list on all ranks) skips the
        small exchange of sizes that an uneven gather otherwise needs. `out`
        receives the result instead of a new tensor (no allocation, which
        matters for large buffers); with `out` and no `sizes`, every rank's
        dim 0 is taken to equal this rank's (debug mode checks it). `tensor`
        may be this rank's own block of `out` (a gather in place, as FSDP
        does): nothing is copied for it.
        """
        t = self._tensor_arg(tensor, "allgather")
        if t.dim() == 0:
            t = t.reshape(1)
        if sizes is not None:
            extra = sum(int(s) for s in sizes)
        else:
            extra = -1 if out is None else t.shape[0] * self.size
        row = t.element_size() * math.prod(t.shape[1:])  # only dim 0 may differ: the check compares rows
        seq = self._begin("allgather", t, "", out is None or sizes is not None, extra=extra, nbytes=row)
        if sizes is None:
            counts = self._exchange_sizes(t, seq) if out is None else [t.shape[0]] * self.size
        else:
            counts = [int(s) for s in sizes]
            if len(counts) != self.size or counts[self.rank] != t.shape[0]:
                raise ValueError(
                    f"allgather: sizes={list(sizes)} must list {self.size} dim-0 sizes with this rank's "
                    f"({t.shape[0]}) at position {self.rank}"
                )
        target = self._out_arg(out, t, (sum(counts), *t.shape[1:]), "allgather", block_at=sum(counts[: self.rank]))
        work = self._allgather(t, counts, seq, target)
        return self._finish(work, tensor if out is None else out, async_op, in_place=out is not None)

    def reduce_scatter(
        self, tensor: ArrayLike, op: str = "sum", *, out: Optional[ArrayLike] = None, async_op: bool = False
    ) -> Any:
        """Reduce `tensor` across ranks and return this rank's slice of dim 0 (dim 0 divisible by size).

        `out` (shape of one slice) receives the result instead of a new tensor.
        """
        t = self._tensor_arg(tensor, "reduce_scatter")
        check_reduce_op(op, t.dtype, "reduce_scatter")
        check_divisible(t, self.size, "reduce_scatter")
        target = self._out_arg(out, t, (t.shape[0] // self.size, *t.shape[1:]), "reduce_scatter")
        seq = self._begin("reduce_scatter", t, f"op={op}")
        work = self._reduce_scatter(t, op, seq, target)
        return self._finish(work, tensor if out is None else out, async_op, in_place=out is not None)

    def broadcast(self, tensor: ArrayLike, root: int = 0, *, async_op: bool = False) -> Any:
        """Copy `root`'s tensor into every rank's `tensor` in place and return it."""
        t = self._tensor_arg(tensor, "broadcast")
        check_root(root, self.size, "broadcast")
        seq = self._begin("broadcast", t, f"root={root}")
        work = self._broadcast(t, root, seq)
        if async_op:
            return work.returns(tensor)
        work.wait()
        return tensor

    def alltoall(self, tensor: ArrayLike, *, out: Optional[ArrayLike] = None, async_op: bool = False) -> Any:
        """Split dim 0 evenly into `size` blocks; block j goes to rank j; return the blocks received (or fill `out`)."""
        t = self._tensor_arg(tensor, "alltoall")
        check_divisible(t, self.size, "alltoall")
        target = self._out_arg(out, t, tuple(t.shape), "alltoall")
        seq = self._begin("alltoall", t, "")
        work = self._alltoall(t, seq, target)
        return self._finish(work, tensor if out is None else out, async_op, in_place=out is not None)

    def barrier(self, *, async_op: bool = False) -> Any:
        """Wait until every rank has arrived (bounded by the timeout like every wait)."""
        self._check_open("barrier")
        seq = self._begin("barrier", None, "")
        if not async_op and self._every:  # the check's allreduce is a barrier too: check for free
            agreement.check(self, seq)
            return None
        work = self._barrier(seq)
        return work if async_op else work.wait()

    def allreduce_coalesced(
        self,
        tensors: Sequence[ArrayLike],
        op: str = "sum",
        *,
        bucket_mb: Optional[float] = None,
        async_op: bool = False,
    ) -> Any:
        """Allreduce many tensors in place with few engine calls (packed into flat buckets).

        Returns the list of tensors (or a handle whose `wait()` returns it).
        `bucket_mb` bounds each flat buffer (default HPDL_FUSION_MB or 64).
        """
        self._check_open("allreduce_coalesced")
        # Per-tensor Python is the cost here (200 gradients: every step): C-level maps where possible, and the
        # same tensors as last time skip the checks they passed then.
        limit = fusion.bucket_bytes(bucket_mb)
        plan = None if self._debug else self._packer.again(tensors, limit)
        if plan is None:
            views: list[torch.Tensor]
            if set(map(type, tensors)) <= _PLAIN_TENSOR:  # C-level: a third of a generator's cost per tensor
                views = tensors if isinstance(tensors, list) else list(tensors)  # type: ignore[assignment,arg-type]
            else:
                views = [as_tensor(x, "allreduce_coalesced") for x in tensors]
            if not all(map(torch.Tensor.is_contiguous, views)):
                for t in views:
                    check_contiguous(t, "allreduce_coalesced")
            plan = self._packer.acquire(views, limit)
        for dtype in plan.dtypes:
            check_reduce_op(op, dtype, "allreduce_coalesced")
        detail = f"op={op} tensors={len(plan.tensors)}"
        if self._debug:  # the shapes' digest costs ~1 us per tensor: only where it is compared
            shapes = ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in plan.tensors)
            detail += f" shapes={zlib.crc32(shapes.encode()):08x}"
        seq = self._begin("allreduce_coalesced", None, detail, extra=plan.nbytes)
        plan.busy = True  # until unpacked
        parts, packed = self._allreduce_buckets(plan.buckets, op, seq, async_op)

        def finish() -> list:
            for bucket in packed:
                bucket.unpack()
            plan.busy = False
            return list(tensors)

        work = chain(self, "allreduce_coalesced", seq, parts, finish)
        return work if async_op else work.wait()

    # ------------------------------------------------------------------ point-to-point
    def send(self, tensor: ArrayLike, dst: int, *, tag: int = 0, async_op: bool = False) -> Any:
        """Send `tensor` to rank `dst` (matched by a `recv` there with the same tag)."""
        t = self._tensor_arg(tensor, "send")
        check_peer(dst, self.size, self.rank, "send", "dst")
        work = self._send(t, dst, tag)
        return self._finish(work, tensor, async_op, in_place=True)

    def recv(self, tensor: ArrayLike, src: Optional[int], *, tag: int = 0, async_op: bool = False) -> Any:
        """Receive into `tensor` (its shape and dtype must match what `src` sends) and return it.

        `src=None` takes the next message with this tag from any rank; with `async_op=True` the returned
        work's `source` says, once it completed, which rank sent it.
        """
        t = self._tensor_arg(tensor, "recv")
        if src is not None:
            check_peer(src, self.size, self.rank, "recv", "src")
        work = self._recv(t, src, tag)
        return self._finish(work, tensor, async_op, in_place=True)

    # ------------------------------------------------------------------ objects (pickled, explicit)
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Send any picklable object from `root` to every rank (slow path: pickles)."""
        self._check_open("broadcast_object")
        check_root(root, self.size, "broadcast_object")
        payload = _pickle(obj) if self.rank == root else torch.empty(0, dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        self.broadcast(length, root)
        if self.rank != root:
            payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self.broadcast(payload, root)
        return obj if self.rank == root else pickle.loads(payload.numpy().tobytes())

    def allgather_object(self, obj: Any) -> list:
        """Gather any picklable object from every rank into a list ordered by rank (pickles)."""
        self._check_open("allgather_object")
        payload = _pickle(obj)
        lengths = self.allgather(torch.tensor([payload.numel()], dtype=torch.int64), sizes=[1] * self.size)
        gathered = self.allgather(payload, sizes=[int(n) for n in lengths])
        out, start = [], 0
        for n in lengths.tolist():
            out.append(pickle.loads(gathered[start : start + n].numpy().tobytes()))
            start += n
        return out

    # ------------------------------------------------------------------ groups and life cycle
    def split(self, color: Optional[int], key: int = 0) -> Optional[Communicator]:
        """A sub-communicator of the ranks that pass the same `color`, ordered by (`key`, rank).

        Every rank must call it; a rank that passes `color=None` gets None.
        """
        self._check_open("split")
        if color is not None and (not isinstance(color, int) or color < 0):
            raise ValueError(f"split: color={color!r} must be a non-negative int or None")
        if not isinstance(key, int):
            raise ValueError(f"split: key={key!r} must be an int")
        seq = self._begin("split", None, "")
        child = self._split(color, key, seq)
        if child is not None:
            self._children.append(child)
        return child

    def start_briefly(self, op: str, tensor: torch.Tensor, arg: Any) -> Any:
        """A blocking `allreduce(tensor, arg)` or `broadcast(tensor, arg)` that waits only briefly: None once it
        completed, its running `Work` after the engine's short wait, or `DECLINED` where the engine has no such
        call (here: never)."""
        return DECLINED

    def shared_buffer(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A 1-D tensor that collectives can reduce without copying it in (zero-copy buckets).

        On the mpi backend with several ranks per node it lives in a window
        of shared memory that the node's ranks read directly; elsewhere it
        is ordinary memory. Collective: every rank calls it with the same
        arguments in the same order.
        """
        self._check_open("shared_buffer")
        return torch.empty(numel, dtype=dtype)

    def peer_buffer(self, buffer: torch.Tensor, rank: int) -> Optional[torch.Tensor]:
        """`rank`'s tensor at the place of `buffer` (a part of this rank's `shared_buffer`) in that rank's own
        shared buffer, mapped here to read and write; None where the two ranks share no memory (here: always).

        Nothing orders these reads and writes: the two ranks agree on when each may touch the other's memory
        (a message each way; `fence_shared` before a message that hands memory over and after one that takes it).
        """
        return None

    def fence_shared(self) -> None:
        """A memory barrier for what `peer_buffer` tensors were written or are to be read (here: nothing to do)."""
        return None

    def close(self) -> None:
        """Release engine resources of this communicator and its sub-communicators."""
        if self._closed:
            return
        for child in reversed(self._children):
            child.close()
        self._close()  # may still meet the other ranks (the exit barrier): not closed yet
        self._closed = True
        self._refresh()
        if self._finalize_error is not None:
            error, self._finalize_error = self._finalize_error, None
            raise error

    def _exit_barrier(self) -> None:
        """Meet every rank before tearing the engine down; a rank that does not come is reported, not awaited."""
        if self._closed:
            return
        if self._broken:  # no meeting (the engine may be stuck), but the others' waits see this rank leave at once
            self._post(self._seq, "left")
            return
        limit = min(self.timeout, EXIT_BARRIER_SECONDS)
        self._finalizing = True
        try:
            seq = self._begin("finalize", None, "")
            self._barrier(seq).wait(timeout=limit)
            if self._every:  # the calls since the last check must not end the job unchecked
                vote = self._ledger.vote()
                self._allreduce(vote, "max", seq).wait(timeout=limit)
                if not self._ledger.agreed():  # raised by close(), once the engine is released
                    self._finalize_error = agreement.mismatch_error(self, seq)
            # A late rank's barrier can match one that the others already gave up on:
            # only ranks that all met in time go on to free what they share.
            self._allreduce(torch.ones(1), "min", seq).wait(timeout=limit)
        except CommError as exc:
            print(f"hpdl: rank {self.rank}: {exc} Closing without waiting.", file=sys.stderr)

    @property
    def engine(self) -> str:
        """What actually moves the bytes (for example 'MPICH 5.0.2' or 'gloo')."""
        return self.backend

    def __repr__(self) -> str:
        return f"<hpdl {self.backend} communicator rank {self.rank} of {self.size}>"

    # ------------------------------------------------------------------ bookkeeping
    def _tensor_arg(self, value: Any, op: str) -> torch.Tensor:
        self._check_open(op)
        t = as_tensor(value, op)
        check_contiguous(t, op)
        return t

    def _out_arg(
        self, out: Any, like: torch.Tensor, shape: tuple, op: str, block_at: Optional[int] = None
    ) -> Optional[torch.Tensor]:
        """Check a caller's output buffer: a contiguous tensor of the result's shape, dtype and device.

        `block_at` (rows): the input may be exactly the output's block that starts there (a gather in place).
        """
        if out is None:
            return None
        target = self._tensor_arg(out, op)
        check_same_device_dtype(target, like, op)
        if tuple(target.shape) != tuple(shape):
            raise ValueError(f"{op}: out has shape {tuple(target.shape)}; the result has shape {tuple(shape)}")
        if block_at is not None and is_block_of(like, target, block_at):
            return target
        if target.data_ptr() == like.data_ptr() and like.numel():
            allowed = "" if block_at is None else " (but an allgather's input may be exactly this rank's block of out)"
            raise ValueError(f"{op}: out must not share memory with the input{allowed}")
        return target

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise NotInitializedError(
                f"{op}: this {self.backend} communicator was closed by hpdl.finalize() (or close()); "
                "call hpdl.init() again for a new one"
            )

    def _begin(
        self,
        op: str,
        tensor: Optional[torch.Tensor],
        detail: str,
        shape_tail_only: bool = False,
        extra: int = 0,
        nbytes: Optional[int] = None,
    ) -> int:
        """Number the collective, publish progress for timeout reports, compare fingerprints in debug mode,
        and fold the call into the agreement signature (checked every `check_every` calls)."""
        self._seq += 1
        seq = self._seq
        self._post(seq, op)
        if self._debug:
            shape = "" if tensor is None else str(tuple(tensor.shape[1:] if shape_tail_only else tensor.shape))
            dtype = "" if tensor is None else str(tensor.dtype).replace("torch.", "")
            mine = fingerprint.Fingerprint(self.rank, seq, op, shape, dtype, detail, fingerprint.call_site())
            fingerprint.verify(self, mine)
        every = self._every
        if every:
            dtype = "" if tensor is None else agreement.dtype_name(tensor.dtype)
            if nbytes is None:
                nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
            self._ring[seq % every] = agreement.entry(agreement.code(op, dtype, detail), nbytes, extra)
            if not seq % every:
                agreement.check(self, seq)
        return seq

    def _post(self, seq: int, op: str) -> None:
        post = self._board().post
        self._post = post  # type: ignore[method-assign]  # bound once: this runs on every collective
        post(seq, op)

    def _exchange_sizes(self, t: torch.Tensor, seq: int) -> list[int]:
        """Every rank's dim-0 size, checking that the other dims agree (one small allgather)."""
        mine = torch.tensor([[t.shape[0], math.prod(t.shape[1:])]], dtype=torch.int64)
        return self._sizes_of(self._allgather(mine, [1] * self.size, seq).wait().view(-1).tolist())

    def _sizes_of(self, table: list[int]) -> list[int]:
        """Every rank's dim 0 from the exchanged (dim 0, elements per row) pairs, which must agree per row."""
        dims, rows = table[0::2], table[1::2]
        if len(set(rows)) > 1:
            raise ValueError(
                f"allgather: ranks pass tensors whose non-leading dims differ (elements per row by rank: "
                f"{rows}); only dim 0 may differ between ranks"
            )
        return dims

    def _finish(self, work: Work, original: Any, async_op: bool, in_place: bool) -> Any:
        if in_place:
            if async_op:
                return work.returns(original)
            work.wait()
            return original
        if not isinstance(original, torch.Tensor):
            work.then(lambda result: like_input(result, original))
        return work if async_op else work.wait()

    def _timeout_error(self, op: str, seq: int, waited: float) -> CommTimeoutError:
        self._broken = True
        if op.startswith(("send", "recv")):  # point-to-point: only the named peer can be missing
            return CommTimeoutError(
                f"{op} did not complete within {waited:.1f} s on rank {self.rank} of {self.size} "
                f"({self.backend}): the peer did not post the matching call (same tag, same size), or is stuck. "
                "Raise the limit with hpdl.init(timeout=...) or HPDL_TIMEOUT if the work is only slow.",
                op=op,
                seq=seq,
            )
        try:
            states = self._board().read(min(2.0, self.timeout))
        except Exception as exc:  # the report must not hide the timeout itself
            states = None
            print(f"hpdl: could not read other ranks' progress: {exc}", file=sys.stderr)
        op = own_op(states, self.rank, seq, op)  # (what the caller called: not a wait inside it, such as the check's)
        detail, missing = describe_laggards(states, self.rank, seq, op, self.hosts)
        advice = (
            "If they are only slow, raise the limit with hpdl.init(timeout=...) or HPDL_TIMEOUT."
            if lost_hosts(states, missing, self.rank, self.hosts)
            else "Every rank must call the same collectives in the same order: run with HPDL_DEBUG=1 to compare "
            "call sites, or raise the limit with hpdl.init(timeout=...) or HPDL_TIMEOUT if the work is only slow."
        )
        message = (
            f"{op} #{seq} did not complete within {waited:.1f} s on rank {self.rank} of {self.size} "
            f"({self.backend}). {detail} {advice}"
        )
        return CommTimeoutError(message, op=op, seq=seq, missing=tuple(missing))

    def _check_peers(self, op: str, seq: int) -> None:
        """Called about once a second while collective `seq` waits: raise when a peer can never join it.

        MPI matches collectives by order only, so a rank that finished early (its script returned,
        `hpdl.finalize`) leaves the others waiting until the timeout, and its exit barrier would wait for
        them. The progress board shows it at once: a peer whose last post is `finalize`, numbered no later
        than this collective, ran fewer collectives than this rank; a peer inside a collective numbered at
        or after this rank's `finalize` runs one that this rank never called.
        """
        if self.size == 1:
            return
        states = self._board().read(min(1.0, self.timeout))
        op = own_op(states, self.rank, seq, op)
        if self._finalizing:
            strays = [
                f"rank {r} waits in {state[1]} #{state[0]}"
                for r, state in enumerate(states)
                if state is not None and r != self.rank and state[1] not in ("", "finalize", "left") and state[0] >= seq
            ]
            gone = [r for r, state in enumerate(states) if state is not None and r != self.rank and state[1] == "left"]
            if gone:
                self._broken = True
                raise CommError(
                    f"rank(s) {', '.join(map(str, gone))} left after an error broke their communicator and will not "
                    f"meet at finalize."
                )
            if strays:
                self._broken = True
                raise CollectiveMismatchError(
                    f"{', '.join(strays)}, which rank {self.rank} never called: its collective #{seq} on this "
                    f"communicator is finalize. The ranks ran different numbers of collectives."
                )
            return
        finished = [
            f"rank {r} (after {state[0] - 1} collectives)"
            if state[1] == "finalize"
            else f"rank {r} (after an error in collective #{state[0]})"
            for r, state in enumerate(states)
            if state is not None and r != self.rank and state[1] in ("finalize", "left") and state[0] <= seq
        ]
        if finished:
            self._broken = True
            raise CollectiveMismatchError(
                f"{op} #{seq} on rank {self.rank} of {self.size} ({self.backend}) cannot complete: "
                f"{', '.join(finished)} finished (hpdl.finalize, the end of its script, or an error) without "
                "calling it. Every rank must call the same collectives in the same order: run with HPDL_DEBUG=1 to "
                "compare call sites."
            )
        if op and mismatched(states, self.rank, seq, op):  # a peer called something else as this number: it never comes
            self._broken = True
            raise self._mismatch_error(op, seq, states)

    def _mismatch_error(self, op: str, seq: int, states: list[State]) -> CollectiveMismatchError:
        """The error of a collective that a peer's progress post shows it called as something else."""
        states = list(states)
        states[self.rank] = (seq, op)
        return CollectiveMismatchError(
            f"{op} #{seq} on rank {self.rank} of {self.size} ({self.backend}) cannot complete: "
            f"{positions(states)}: {different_collectives(seq)}. Every rank must call the same collectives in the "
            "same order: run with HPDL_DEBUG=1 to compare call sites."
        )

    def _engine_error(self, op: str, seq: int, exc: Exception) -> Exception:
        """What to raise when the engine itself fails while `op` completes: `exc`, or a backend's clearer error."""
        return exc

    def _vote(self, vote: torch.Tensor, seq: int) -> None:
        """The agreement check's 16-byte MAX allreduce (agreement.check; a backend may have a shorter one, or one on
        a channel of its own, which no user collective can match)."""
        self._allreduce(vote, "max", seq).wait()

    def _vote_gather(self, t: torch.Tensor, seq: int) -> torch.Tensor:
        """The agreement check's exchange of the ranks' rings (uint8, one block per rank), on `_vote`'s channel."""
        return self._allgather(t, [t.numel()] * self.size, seq).wait()

    def _trace_op(self, op: str, started: float) -> None:
        if self.tracer is not None:
            self.tracer.complete(op, started, time.perf_counter(), category="comm")

    # ------------------------------------------------------------------ backend
    @abstractmethod
    def _board(self) -> ProgressBoard: ...

    @abstractmethod
    def _allreduce(self, t: torch.Tensor, op: str, seq: int) -> Work: ...

    def _allreduce_buckets(
        self, buckets: list[fusion.Bucket], op: str, seq: int, async_op: bool
    ) -> tuple[list[Work], list[fusion.Bucket]]:
        """Start the allreduce of one coalesced call's buckets: the works, and the buckets whose flat buffers the
        caller unpacks once they are done (an engine may reduce a bucket straight from and into its tensors)."""
        for bucket in buckets:
            bucket.fill()
        return self._allreduce_flat([bucket.flat for bucket in buckets], op, seq, async_op), buckets

    def _allreduce_flat(self, flats: list[torch.Tensor], op: str, seq: int, async_op: bool) -> list[Work]:
        """Start the allreduce of each fused buffer of one coalesced call (an engine that can wait more cheaply
        than a `Work` for a blocking caller finishes them there)."""
        return [self._allreduce(flat, op, seq) for flat in flats]

    @abstractmethod
    def _allgather(self, t: torch.Tensor, sizes: list[int], seq: int, out: Optional[torch.Tensor] = None) -> Work: ...

    @abstractmethod
    def _reduce_scatter(self, t: torch.Tensor, op: str, seq: int, out: Optional[torch.Tensor] = None) -> Work: ...

    @abstractmethod
    def _broadcast(self, t: torch.Tensor, root: int, seq: int) -> Work: ...

    @abstractmethod
    def _alltoall(self, t: torch.Tensor, seq: int, out: Optional[torch.Tensor] = None) -> Work: ...

    @abstractmethod
    def _barrier(self, seq: int) -> Work: ...

    @abstractmethod
    def _send(self, t: torch.Tensor, dst: int, tag: int) -> Work: ...

    @abstractmethod
    def _recv(self, t: torch.Tensor, src: Optional[int], tag: int) -> Work: ...

    @abstractmethod
    def _split(self, color: Optional[int], key: int, seq: int) -> Optional[Communicator]: ...

    @abstractmethod
    def _close(self) -> None: ...


_PLAIN_TENSOR = frozenset({torch.Tensor})


def own_op(states: Optional[list[State]], rank: int, seq: int, op: str) -> str:
    """What this rank called as collective `seq`: its own progress post (a wait inside the call, such as the
    agreement check's vote, may be named after its engine operation), else `op` as the wait names it."""
    own = states[rank] if states is not None and 0 <= rank < len(states) else None
    if own is not None and own[0] == seq and own[1] not in ("", "left"):
        return own[1]
    return op.split(" (")[0]


def is_block_of(t: torch.Tensor, out: torch.Tensor, rows_before: int) -> bool:
    """Whether `t` is exactly the block of `out` that starts `rows_before` rows in (an allgather in place)."""
    row = t.element_size() * math.prod(t.shape[1:])
    return bool(t.numel()) and t.device == out.device and t.data_ptr() == out.data_ptr() + rows_before * row


def _pickle(obj: Any) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
