"""The mpi backend's general paths: every collective, on any tensor, through a nonblocking call and a `Work`.

The base class (base.Communicator) has checked the arguments, numbered the
call and recorded its agreement entry; these start the operation: on the
node's shared-memory engine when it takes the size (mpi_node.py), as the
pair's messages on two ranks (pairs.py), else MPI's nonblocking collective.
CUDA tensors go to a CUDA-aware MPI directly, else through host memory.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch

from hpdl.comm.base import is_block_of
from hpdl.comm.mpi_base import NO_WAIT, MpiBase
from hpdl.comm.mpi_board import peer_name, recv_error, short_message
from hpdl.comm.mpi_library import (
    HALF,
    MPI,
    NATIVE,
    OPS,
    buffer,
    copy_back,
    deliver,
    memory,
    move_type,
    output,
    reduce_op,
)
from hpdl.comm.work import Work, completed

__all__ = ["GeneralPaths", "DEVICE_PAIR_BELOW"]

DEVICE_PAIR_BELOW = 4 << 20
"""A CUDA tensor on CUDA-aware MPI goes as a reduce_scatter's messages (through host memory: the reduction runs on
the CPU) only below these bytes each way; from there MPI's collective reads device memory. The cap the CPU's
shared-memory gate set before messages took every size on the CPU (2026-12-05); not yet measured on a GPU."""


class GeneralPaths(MpiBase):
    """The base's per-operation hooks (`_allreduce`, `_allgather`, ...) on MPI."""

    def _allreduce(self, t: torch.Tensor, op: str, seq: int) -> Work:
        if node := self._shared_memory("allreduce", t.numel() * t.element_size(), t):
            node.allreduce(t, op, self._across_nodes if self._cross is not None else None)
            if op == "avg":
                t.div_(self.size)
            return completed(self, "allreduce", seq, t)
        if self._pair_allreduce_below and t.numel() * (4 if t.dtype in HALF else t.element_size()) < (
            self._pair_allreduce_below
        ):
            return self._pair_allreduce(t, op, seq)
        if t.is_cpu and t.dtype in NATIVE:  # the common case, kept short: it runs for every bucket
            request = self.mpi_comm.Iallreduce(MPI.IN_PLACE, [memory(t), NATIVE[t.dtype]], OPS[op])
            average = (lambda: t.div_(self.size)) if op == "avg" else None
            return Work(self, "allreduce", seq, request.Test, average, keep=t)
        host = self._host(t)
        wire = host.float() if t.dtype in HALF else host
        request = self.mpi_comm.Iallreduce(
            MPI.IN_PLACE, buffer(wire, move_type(wire, "allreduce")), reduce_op(wire, op)
        )

        def finish() -> torch.Tensor:
            if op == "avg":
                wire.div_(self.size)
            if wire is not t:
                t.copy_(wire)
            return t

        return self._work("allreduce", seq, request, finish)

    def _pair_allreduce(self, t: torch.Tensor, op: str, seq: int) -> Work:
        """A two-rank allreduce as messages (pairs.py): on the host, 16-bit floats in float32."""
        wire = self._host(t, messages=True)
        if t.dtype in HALF:
            wire = wire.float()
        handle = self._handle_of
        request = self._pair.allreduce(
            wire.data_ptr(), wire.nbytes, handle(move_type(wire, "allreduce")), handle(reduce_op(wire, op)),
            NO_WAIT,
        )  # fmt: skip

        def finish() -> torch.Tensor:
            if op == "avg":
                wire.div_(self.size)
            return copy_back(t, wire)

        return Work(self, "allreduce", seq, request.Test, finish, keep=wire)

    def _allgather(self, t: torch.Tensor, sizes: list[int], seq: int, out: Optional[torch.Tensor] = None) -> Work:
        total = sum(sizes) * math.prod(t.shape[1:]) * t.element_size()
        if node := self._shared_memory("allgather", total, t):
            result = out if out is not None else torch.empty((sum(sizes), *t.shape[1:]), dtype=t.dtype)
            node.allgather(t, sizes, result)
            return completed(self, "allgather", seq, result)
        row = math.prod(t.shape[1:])
        paired = len(set(sizes)) == 1 and t.numel() * t.element_size() < self._pair_allgather_below
        host = self._host(t, messages=paired)
        out_host = output(out, host, (sum(sizes), *t.shape[1:]), t.dtype)
        dtype = move_type(t, "allgather")
        in_place = is_block_of(host, out_host, sum(sizes[: self.rank]))
        send = MPI.IN_PLACE if in_place else buffer(host, dtype)
        if paired:
            request = self._pair.allgather(
                0 if in_place else host.data_ptr(), out_host.data_ptr(), host.nbytes, self._handle_of(dtype),
                NO_WAIT,
            )  # fmt: skip
        elif len(set(sizes)) == 1:
            request = self.mpi_comm.Iallgather(send, buffer(out_host, dtype))
        else:
            counts = [n * row for n in sizes]
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
            request = self.mpi_comm.Iallgatherv(send, [memory(out_host), counts, displs, dtype])

        return self._work("allgather", seq, request, lambda: deliver(out_host, out, t.device), host)

    def _reduce_scatter(self, t: torch.Tensor, op: str, seq: int, out: Optional[torch.Tensor] = None) -> Work:
        if node := self._shared_memory("reduce_scatter", t.numel() * t.element_size(), t):
            result = out if out is not None else torch.empty((t.shape[0] // self.size, *t.shape[1:]), dtype=t.dtype)
            node.reduce_scatter(t, op, result)
            if op == "avg":
                result.div_(self.size)
            return completed(self, "reduce_scatter", seq, result)
        wire_bytes = t.numel() * (4 if t.dtype in HALF else t.element_size())
        each_way = wire_bytes // self.size
        on_device = self.cuda_aware and t.device.type == "cuda"  # MPI reads it where it is; messages stage it
        paired = each_way < self._pair_reduce_scatter_below and (not on_device or each_way < DEVICE_PAIR_BELOW)
        host = self._host(t, messages=paired)
        wire = host.float() if t.dtype in HALF else host
        result = output(out, wire, (t.shape[0] // self.size, *t.shape[1:]), wire.dtype)
        dtype = move_type(wire, "reduce_scatter")
        low, high = self._counted_reduce_scatter
        if paired:
            request = self._pair.reduce_scatter(
                wire.data_ptr(), result.data_ptr(), result.nbytes, self._handle_of(dtype),
                self._handle_of(reduce_op(wire, op)), NO_WAIT,
            )  # fmt: skip
        elif low <= wire.nbytes < high:  # the same operation, through the call that is fast at these sizes
            count = result.numel()
            request = self.mpi_comm.Ireduce_scatter(
                buffer(wire, dtype), buffer(result, dtype), [count] * self.size, reduce_op(wire, op)
            )
        else:
            request = self.mpi_comm.Ireduce_scatter_block(
                buffer(wire, dtype), buffer(result, dtype), reduce_op(wire, op)
            )

        def finish() -> torch.Tensor:
            if op == "avg":
                result.div_(self.size)
            return deliver(result, out, t.device, t.dtype)

        return self._work("reduce_scatter", seq, request, finish, wire)

    def _broadcast(self, t: torch.Tensor, root: int, seq: int) -> Work:
        if node := self._shared_memory("broadcast", t.numel() * t.element_size(), t):
            node.broadcast(t, root)
            return completed(self, "broadcast", seq, t)
        nbytes = t.numel() * t.element_size()
        if nbytes < self._pair_broadcast_below:
            host = self._host(t, messages=True)
            handle = self._handle_of(move_type(t, "broadcast"))
            request = self._pair.broadcast(host.data_ptr(), nbytes, handle, root, NO_WAIT)
        else:
            host = self._host(t)
            request = self.mpi_comm.Ibcast(buffer(host, move_type(t, "broadcast")), root=root)
        return self._work("broadcast", seq, request, lambda: copy_back(t, host))

    def _alltoall(self, t: torch.Tensor, seq: int, out: Optional[torch.Tensor] = None) -> Work:
        host = self._host(t)
        result = output(out, host, tuple(t.shape), t.dtype)
        dtype = move_type(t, "alltoall")
        request = self.mpi_comm.Ialltoall(buffer(host, dtype), buffer(result, dtype))
        return self._work("alltoall", seq, request, lambda: deliver(result, out, t.device), host)

    def _barrier(self, seq: int) -> Work:
        return self._work("barrier", seq, self.mpi_comm.Ibarrier(), lambda: None)

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> Work:
        host = self._host(t)
        request = self.mpi_comm.Isend(buffer(host, move_type(t, "send")), dest=dst, tag=tag)
        return self._work(f"send to {dst}", -1, request, lambda: t, host)

    def _recv(self, t: torch.Tensor, src: Optional[int], tag: int) -> Work:
        host = self._host(t)
        if self._probe_first:
            return self._recv_after_probe(t, host, src, tag)
        source = MPI.ANY_SOURCE if src is None else src
        request = self.mpi_comm.Irecv(buffer(host, move_type(t, "recv")), source=source, tag=tag)
        status = MPI.Status()

        def test() -> bool:
            try:
                return bool(request.Test(status))
            except MPI.Exception as exc:
                raise recv_error(exc, src, tag, t) from None

        def finish() -> torch.Tensor:
            work.source = status.Get_source()
            if status.Get_count(MPI.BYTE) != t.numel() * t.element_size():
                raise short_message(status.Get_count(MPI.BYTE), work.source, tag, t)
            return copy_back(t, host)

        work = Work(self, f"recv from {peer_name(src)}", -1, test, finish, keep=host)
        return work

    def _recv_after_probe(self, t: torch.Tensor, host: torch.Tensor, src: Optional[int], tag: int) -> Work:
        """A receive posted once a matched probe has told the message's length, into a buffer that holds it: Open MPI
        5.0.11 writes a message longer than the receive's count past the end of the tensor (pairs.probe_first)."""
        status = MPI.Status()
        nbytes = t.numel() * t.element_size()
        matched: list[Any] = []  # the receive, once the probe matched its message

        def test() -> bool:
            try:
                if not matched:
                    message = self.mpi_comm.Improbe(MPI.ANY_SOURCE if src is None else src, tag, status)
                    if message is None:
                        return False
                    got = status.Get_count(MPI.BYTE)
                    into = buffer(host, move_type(t, "recv")) if got <= nbytes else [bytearray(got), MPI.BYTE]
                    matched.append(message.Irecv(into))
                return bool(matched[0].Test(status))
            except MPI.Exception as exc:
                raise recv_error(exc, src, tag, t) from None

        def finish() -> torch.Tensor:
            work.source = status.Get_source()
            if status.Get_count(MPI.BYTE) != nbytes:
                raise short_message(status.Get_count(MPI.BYTE), work.source, tag, t)
            return copy_back(t, host)

        work = Work(self, f"recv from {peer_name(src)}", -1, test, finish, keep=host)
        return work
