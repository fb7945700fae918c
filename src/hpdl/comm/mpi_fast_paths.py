"""The mpi backend's fast paths: the common call in the fewest steps, with every guarantee of the general path.

The common call is an ordinary contiguous CPU tensor below the shared-memory
thresholds, with debug and tracing off: the same checks, numbering, progress
post and agreement entry as the general path (base.Communicator), with what
can be cached cached per (dtype, op). A blocking call builds no Work object,
closure or list unless the engine is still busy after its short wait; a
non-blocking one (DataParallel's buckets, the torch backend's every call)
gets the same Work the general path would give, without the general path's
per-call lookups. Anything else takes the general path.

Where the compiled module runs, its `Fast` takes the blocking calls of
allreduce, allgather, reduce_scatter, broadcast, send and recv before these
methods see them (mpi_compiled.py); these stay the reference, and take every
call it passes on. Both read and write the communicator's state through
`_state` (fast_state.py).
"""

from __future__ import annotations

import math
import threading
from typing import Any, Optional

import torch

from hpdl.comm import agreement
from hpdl.comm.base import DECLINED
from hpdl.comm.mpi_base import INT_COUNT, NO_WAIT, WAIT, MpiBase
from hpdl.comm.mpi_board import recv_error, short_message
from hpdl.comm.mpi_library import MPI
from hpdl.comm.progress import OP_CODES
from hpdl.comm.work import Work, completed

__all__ = ["FastPaths"]

_Tensor = torch.Tensor
_BYTE = MPI.BYTE
_SEQUENCES = (list, tuple)
_ALLREDUCE, _ALLGATHER, _REDUCE_SCATTER, _BROADCAST = (
    OP_CODES[name] for name in ("allreduce", "allgather", "reduce_scatter", "broadcast")
)
_entry = agreement.entry


class _Declined(Exception):
    """Inside `start_briefly`: the fast path did not take the call (see `_decline_brief`)."""


class FastPaths(MpiBase):
    """allreduce, allgather, reduce_scatter, broadcast, send and recv: the fast path first, else the base's."""

    def allreduce(self, tensor: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        state = self._state
        if type(tensor) is _Tensor and state.plain:
            spec = self._fast_allreduce.get((tensor.dtype, op))
            if spec is not None and tensor.is_cpu and tensor.is_contiguous():
                nbytes = tensor.nbytes
                if nbytes < state.fast_allreduce_below:
                    seq = state.seq = state.seq + 1
                    slots = self._slots
                    slots[0] = seq
                    slots[1] = _ALLREDUCE
                    every = state.every
                    if every:
                        state.ring[seq % every] = _entry(spec[2], nbytes)
                        if not seq % every:
                            agreement.check(self, seq)
                    try:
                        request = self._call_allreduce(
                            self._handle, tensor.data_ptr(), nbytes, spec[0], spec[1], NO_WAIT if async_op else WAIT
                        )
                        if async_op:
                            average = (lambda: tensor.div_(self.size)) if op == "avg" else None
                            return Work(self, "allreduce", seq, request.Test, average, keep=tensor).returns(tensor)
                        if request is not None:
                            self._fast_slow("allreduce", seq, tensor, request, 0)
                    except MPI.Exception as exc:
                        raise self._engine_error("allreduce", seq, exc) from exc
                    if op == "avg":
                        tensor.div_(self.size)
                    return tensor
        self._decline_brief()
        return super().allreduce(tensor, op, async_op=async_op)

    def allgather(
        self, tensor: Any, *, sizes: Any = None, out: Any = None, async_op: bool = False
    ) -> Any:  # fmt: skip
        state = self._state
        if out is None and type(tensor) is _Tensor and type(sizes) in _SEQUENCES and state.plain:
            shape = tensor.shape  # equal sizes and no `out` (torch's list all_gather): the new tensor made here
            if shape and len(sizes) == self.size and sizes.count(shape[0]) == self.size and tensor.is_cpu:
                out = torch.empty((shape[0] * self.size, *shape[1:]), dtype=tensor.dtype)
                sizes = None  # (checked: with `out`, no sizes means every rank's dim 0 equals this one's)
        # (with `out` and no `sizes` every rank's dim 0 is taken to equal this rank's, as the general path takes it)
        if type(tensor) is _Tensor and type(out) is _Tensor and (sizes is None or type(sizes) in _SEQUENCES) and (
            state.plain
        ):  # fmt: skip
            spec = self._fast_move.get(tensor.dtype)
            shape = tensor.shape
            whole = out.shape
            size = self.size
            if (  # (trailing dims compared only when there are any: slicing a torch.Size costs 0.2 us)
                spec is not None and shape and len(whole) == len(shape) and whole[0] == shape[0] * size
                and (len(shape) == 1 or whole[1:] == shape[1:]) and out.dtype == tensor.dtype and tensor.is_cpu
                and out.is_cpu and tensor.is_contiguous() and out.is_contiguous()
                and (sizes is None or (len(sizes) == size and sizes.count(shape[0]) == size))
            ):  # fmt: skip
                nbytes = tensor.nbytes
                mine = tensor.data_ptr()
                at = out.data_ptr()
                in_place = mine == at + nbytes * self.rank and nbytes
                if mine == at and nbytes and not in_place:  # the general path says what is wrong
                    return super().allgather(tensor, sizes=sizes, out=out, async_op=async_op)
                if nbytes * size < state.fast_allgather_below:
                    seq = state.seq = state.seq + 1
                    slots = self._slots
                    slots[0] = seq
                    slots[1] = _ALLGATHER
                    every = state.every
                    if every:
                        row = nbytes // shape[0] if shape[0] else tensor.element_size() * math.prod(shape[1:])
                        state.ring[seq % every] = _entry(spec[1], row, shape[0] * size)
                        if not seq % every:
                            agreement.check(self, seq)
                    try:
                        request = self._call_allgather(
                            self._handle, 0 if in_place else mine, at, nbytes, spec[0],
                            NO_WAIT if async_op else WAIT,
                        )  # fmt: skip
                        if async_op:
                            return Work(self, "allgather", seq, request.Test, keep=(tensor, out)).returns(out)
                        if request is not None:
                            Work(self, "allgather", seq, request.Test, keep=(tensor, out)).wait()
                    except MPI.Exception as exc:
                        raise self._engine_error("allgather", seq, exc) from exc
                    return out
        return super().allgather(tensor, sizes=sizes, out=out, async_op=async_op)

    def _exchange_sizes(self, t: torch.Tensor, seq: int) -> list[int]:
        """The base's exchange of sizes through the fast path's call (back to back on 2 ranks, 4 KiB: an allgather
        with neither `sizes` nor `out` took 31 us, 15 of them this exchange through the general path)."""
        state = self._state
        spec = self._fast_move.get(torch.int64)
        if spec is None or not state.plain:
            return super()._exchange_sizes(t, seq)
        mine = torch.tensor([t.shape[0], math.prod(t.shape[1:])], dtype=torch.int64)
        table = torch.empty(2 * self.size, dtype=torch.int64)
        try:
            request = self._call_allgather(self._handle, mine.data_ptr(), table.data_ptr(), 16, spec[0], WAIT)
            if request is not None:
                Work(self, "allgather", seq, request.Test, keep=(mine, table)).wait()
        except MPI.Exception as exc:
            raise self._engine_error("allgather", seq, exc) from exc
        return self._sizes_of(table.tolist())

    def reduce_scatter(self, tensor: Any, op: str = "sum", *, out: Any = None, async_op: bool = False) -> Any:
        state = self._state
        if type(tensor) is _Tensor and state.plain and (out is None or type(out) is _Tensor):
            spec = self._fast_reduce_scatter.get((tensor.dtype, op))
            shape = tensor.shape
            size = self.size
            if spec is not None and shape and not shape[0] % size and tensor.is_cpu and tensor.is_contiguous():
                nbytes = tensor.nbytes
                mine = tensor.data_ptr()
                if out is None:
                    out = torch.empty((shape[0] // size, *shape[1:]), dtype=tensor.dtype)
                    at = out.data_ptr()
                else:
                    block = out.shape
                    at = out.data_ptr()
                    if not (
                        len(block) == len(shape) and block[0] * size == shape[0]
                        and (len(shape) == 1 or block[1:] == shape[1:]) and out.dtype == tensor.dtype
                        and out.is_cpu and out.is_contiguous() and (at != mine or not block[0])
                    ):  # fmt: skip
                        return super().reduce_scatter(tensor, op, out=out, async_op=async_op)  # it says what is wrong
                if nbytes < state.fast_reduce_scatter_below:
                    seq = state.seq = state.seq + 1
                    slots = self._slots
                    slots[0] = seq
                    slots[1] = _REDUCE_SCATTER
                    every = state.every
                    if every:
                        state.ring[seq % every] = _entry(spec[2], nbytes)
                        if not seq % every:
                            agreement.check(self, seq)
                    try:
                        request = self._call_reduce_scatter(
                            self._handle, mine, at, nbytes // size, spec[0], spec[1],
                            NO_WAIT if async_op else WAIT,
                        )  # fmt: skip
                        if async_op:
                            average = (lambda: out.div_(size)) if op == "avg" else None
                            work = Work(self, "reduce_scatter", seq, request.Test, average, keep=(tensor, out))
                            return work.returns(out)
                        if request is not None:
                            Work(self, "reduce_scatter", seq, request.Test, keep=(tensor, out)).wait()
                    except MPI.Exception as exc:
                        raise self._engine_error("reduce_scatter", seq, exc) from exc
                    if op == "avg":
                        out.div_(size)
                    return out
        return super().reduce_scatter(tensor, op, out=out, async_op=async_op)

    def broadcast(self, tensor: Any, root: int = 0, *, async_op: bool = False) -> Any:
        state = self._state
        if type(tensor) is _Tensor and type(root) is int and state.plain:  # (True or np.int64(1) would match 1)
            spec = self._fast_broadcast.get((tensor.dtype, root))
            if spec is None and 0 <= root < self.size:
                spec = self._fast.add_broadcast(tensor.dtype, root)
            if spec is not None and tensor.is_cpu and tensor.is_contiguous():
                nbytes = tensor.nbytes
                if nbytes < state.fast_broadcast_below:
                    seq = state.seq = state.seq + 1
                    slots = self._slots
                    slots[0] = seq
                    slots[1] = _BROADCAST
                    every = state.every
                    if every:
                        state.ring[seq % every] = _entry(spec[1], nbytes)
                        if not seq % every:
                            agreement.check(self, seq)
                    try:
                        request = self._call_broadcast(
                            self._handle, tensor.data_ptr(), nbytes, spec[0], root, NO_WAIT if async_op else WAIT
                        )
                        if async_op:
                            return Work(self, "broadcast", seq, request.Test, keep=tensor).returns(tensor)
                        if request is not None:
                            self._fast_slow("broadcast", seq, tensor, request, 0)
                    except MPI.Exception as exc:
                        raise self._engine_error("broadcast", seq, exc) from exc
                    return tensor
        self._decline_brief()
        return super().broadcast(tensor, root, async_op=async_op)

    def send(self, tensor: Any, dst: int, *, tag: int = 0, async_op: bool = False) -> Any:
        state = self._state
        if type(tensor) is _Tensor and type(dst) is int and state.plain and not async_op:
            spec = self._fast_move.get(tensor.dtype)
            if (
                spec is not None and 0 <= dst < self.size and dst != self.rank
                and tensor.is_cpu and tensor.is_contiguous() and tensor.nbytes < INT_COUNT
            ):  # fmt: skip
                try:
                    request = self._call_send(self._handle, tensor.data_ptr(), tensor.nbytes, spec[0], dst, tag, WAIT)
                    if request is not None:
                        Work(self, f"send to {dst}", -1, request.Test, keep=tensor).wait()
                except MPI.Exception as exc:
                    raise self._engine_error(f"send to {dst}", -1, exc) from exc
                return tensor
        return super().send(tensor, dst, tag=tag, async_op=async_op)

    def recv(self, tensor: Any, src: Optional[int], *, tag: int = 0, async_op: bool = False) -> Any:
        state = self._state
        if type(tensor) is _Tensor and type(src) is int and state.plain and not async_op and not self._probe_first:
            spec = self._fast_move.get(tensor.dtype)
            if (
                spec is not None and 0 <= src < self.size and src != self.rank
                and tensor.is_cpu and tensor.is_contiguous() and tensor.nbytes < INT_COUNT
            ):  # fmt: skip
                nbytes = tensor.nbytes
                try:
                    got = self._call_recv(self._handle, tensor.data_ptr(), nbytes, spec[0], src, tag, WAIT)
                    if type(got) is not int:
                        status = self._status
                        Work(self, f"recv from {src}", -1, lambda: got.Test(status), keep=tensor).wait()
                        got = status.Get_count(_BYTE)
                except MPI.Exception as exc:
                    raise recv_error(exc, src, tag, tensor) from None
                if got != nbytes:
                    raise short_message(got, src, tag, tensor)
                return tensor
        return super().recv(tensor, src, tag=tag, async_op=async_op)

    def _peer_finish(
        self, kind: str, peer: int, tag: int, tensor: torch.Tensor, request: Any, code: int, got: int
    ) -> torch.Tensor:
        """The compiled send's and recv's way out (mpi_compiled.py): the bounded wait of one still running after
        the short wait (`request`), MPI's error `code`, or a receive's wrong length `got`; the errors the Python
        paths above raise."""
        what = f"send to {peer}" if kind == "send" else f"recv from {peer}"
        try:
            if request is None and code:
                raise MPI.Exception(code)
            if request is not None:
                status = self._status
                Work(self, what, -1, lambda: request.Test(status), keep=tensor).wait()
                got = status.Get_count(_BYTE)
        except MPI.Exception as exc:
            if kind == "send":
                raise self._engine_error(what, -1, exc) from exc
            raise recv_error(exc, peer, tag, tensor) from None
        if kind == "recv" and got != tensor.nbytes:
            raise short_message(got, peer, tag, tensor)
        return tensor

    def start_briefly(self, op: str, tensor: torch.Tensor, arg: Any) -> Any:
        """The fast path's blocking call, compiled where built, with the fast path's own short wait (`WAIT`) and
        no longer: for the torch backend, which issues under the lock that orders its calls (blocking there for
        an operation that a peer joins late would keep this process's other threads from issuing theirs), and
        through this saves the `Work` and the Python loop of tests that most small calls never need.

        Which calls qualify is the fast paths' own decision, not a copy of their conditions: a call they do not
        take reaches the general path, which stops it at its door (`_decline_brief`) before it starts anything."""
        if op == "allreduce" and arg == "avg":
            return DECLINED  # the fast path divides after its wait: handed back still running, it would divide early
        handed: list[Work] = []
        self._hand_back = (threading.get_ident(), handed)  # (another thread's call on this communicator waits)
        try:
            if op == "allreduce":
                self.allreduce(tensor, arg)
            else:
                self.broadcast(tensor, arg)
        except _Declined:
            return DECLINED
        finally:
            self._hand_back = None
        return handed[0] if handed else None

    def _decline_brief(self) -> None:
        """The general path's door inside this thread's `start_briefly`: nothing numbered or started yet."""
        hand_back = self._hand_back
        if hand_back is not None and hand_back[0] == threading.get_ident():
            raise _Declined

    def _fast_slow(self, op: str, seq: int, keep: Any, request: Any, code: int) -> None:
        """The fast paths' way out: the bounded wait of an operation still running after their own short wait (or,
        inside `start_briefly`, its `Work` handed back), or the error of an MPI call that failed (`request` None,
        MPI's error `code`)."""
        try:
            if request is None:
                raise MPI.Exception(code)
            work: Work = Work(self, op, seq, request.Test, keep=keep)
            if self._hand_back is not None and self._hand_back[0] == threading.get_ident():
                self._hand_back[1].append(work)
                return
            work.wait()
        except MPI.Exception as exc:
            raise self._engine_error(op, seq, exc) from exc

    def _allreduce_flat(self, flats: list[torch.Tensor], op: str, seq: int, async_op: bool) -> list[Work]:
        """A blocking caller's fused buffers below the gates go through the fast path's call, and the last one
        is waited for there (in C without the GIL where compiled: 20-40 us less for 800 KB than a `Work`'s
        loop of tests); the others as for any caller."""
        state = self._state
        if async_op or op == "avg":
            return super()._allreduce_flat(flats, op, seq, async_op)
        works = []
        last = flats[-1] if flats else None
        for flat in flats:
            spec = self._fast_allreduce.get((flat.dtype, op))
            nbytes = flat.nbytes
            if spec is None or not flat.is_cpu or nbytes >= state.fast_allreduce_below:
                works.append(self._allreduce(flat, op, seq))
                continue
            try:
                request = self._call_allreduce(
                    self._handle, flat.data_ptr(), nbytes, spec[0], spec[1], WAIT if flat is last else NO_WAIT
                )
            except MPI.Exception as exc:
                raise self._engine_error("allreduce_coalesced", seq, exc) from exc
            if request is None:
                works.append(completed(self, "allreduce_coalesced", seq, flat))
            else:
                works.append(Work(self, "allreduce_coalesced", seq, request.Test, keep=flat))
        return works
