"""The `mpi` backend: collectives on torch tensors through mpi4py, without copies.

Contiguous CPU tensors go to MPI as raw memory (address, count, datatype),
so no pickling and no copy. float16 and bfloat16 have no MPI datatype:
they move as 16-bit words and are reduced in float32. GPU tensors go to MPI
directly when the library is CUDA-aware (`cuda_aware()`), else they are
staged through host memory. Every call is non-blocking underneath, so every
wait can time out.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Callable, Optional

import numpy as np
import torch

from hpdl.comm.base import Communicator, env_flag
from hpdl.comm.progress import OP_CODES, OP_NAMES, ProgressBoard, State
from hpdl.comm.work import Work, poll_until
from hpdl.errors import BackendUnavailableError

try:
    from mpi4py import MPI
except ImportError as _exc:  # pragma: no cover - exercised only without mpi4py
    raise BackendUnavailableError(
        f"the mpi backend needs mpi4py ({_exc}); install it with `pip install mpi4py mpich` "
        "(or build mpi4py against your cluster's MPI: `pip install --no-binary mpi4py mpi4py`)"
    ) from None

__all__ = ["MpiCommunicator", "cuda_aware", "library_version"]

_MOVE_TYPES = {
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.float16: MPI.UINT16_T,
    torch.bfloat16: MPI.UINT16_T,
    torch.int8: MPI.INT8_T,
    torch.uint8: MPI.UINT8_T,
    torch.int16: MPI.INT16_T,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.bool: MPI.C_BOOL,
    torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX,
}
for _name, _mpi in (("uint16", MPI.UINT16_T), ("uint32", MPI.UINT32_T), ("uint64", MPI.UINT64_T)):
    if hasattr(torch, _name):
        _MOVE_TYPES[getattr(torch, _name)] = _mpi

_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "prod": MPI.LAND}
_HALF = (torch.float16, torch.bfloat16)
_EMPTY = bytearray(8)


def library_version() -> str:
    """The MPI library's name and version from its own version text (for example 'MPICH 5.0.2')."""
    first = MPI.Get_library_version().strip().splitlines()[0]
    return " ".join(first.replace("Version:", "").split())


def cuda_aware() -> bool:
    """Whether the MPI library accepts CUDA device pointers (HPDL_MPI_CUDA_AWARE=0/1 overrides)."""
    if os.environ.get("HPDL_MPI_CUDA_AWARE") is not None:
        return env_flag("HPDL_MPI_CUDA_AWARE")
    for path in _loaded_mpi_libraries():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "MPIX_Query_cuda_support"):  # Open MPI, MVAPICH2
            return bool(lib.MPIX_Query_cuda_support())
        if hasattr(lib, "MPIX_GPU_query_support"):  # MPICH >= 4
            flag = ctypes.c_int(0)
            lib.MPIX_GPU_query_support(ctypes.c_int(0), ctypes.byref(flag))  # 0: MPIX_GPU_SUPPORT_CUDA
            return bool(flag.value)
    return False


def _loaded_mpi_libraries() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and ".so" in line}
    except OSError:
        return []
    return sorted(paths)


def _memory(t: torch.Tensor) -> Any:
    nbytes = t.numel() * t.element_size()
    return MPI.buffer.fromaddress(t.data_ptr(), nbytes) if nbytes else _EMPTY[:0]


def _buffer(t: torch.Tensor, dtype: Any) -> list:
    """[memory, datatype]: mpi4py derives the count (per rank where the call needs it) from the length."""
    return [_memory(t), dtype]


def _move_type(t: torch.Tensor, op: str) -> Any:
    try:
        return _MOVE_TYPES[t.dtype]
    except KeyError:
        raise TypeError(f"{op}: dtype {t.dtype} is not supported on the mpi backend") from None


def _reduce_op(t: torch.Tensor, op: str) -> Any:
    return _BOOL_OPS[op] if t.dtype == torch.bool else _OPS[op]


class WindowBoard(ProgressBoard):
    """Progress posted into an MPI window; read with one-sided gets that need no help from the target."""

    def __init__(self, comm: Any):
        self._comm = comm
        self._win = MPI.Win.Allocate(16, 8, comm=comm)
        self._mine = np.frombuffer(self._win.tomemory(), dtype=np.int64)  # type: ignore[call-overload]
        self._mine[:] = 0
        self._win.Lock_all()

    def post(self, seq: int, op: str) -> None:
        self._mine[0] = seq
        self._mine[1] = OP_CODES.get(op, 0)

    def read(self, timeout: float) -> list[State]:
        import time

        deadline = time.perf_counter() + timeout
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


class MpiCommunicator(Communicator):
    """A communicator over an mpi4py `Comm` (COMM_WORLD or one made by `split`)."""

    backend = "mpi"

    def __init__(self, mpi_comm: Any, *, timeout: float, debug: bool):
        node = node_comm(mpi_comm)
        super().__init__(
            rank=mpi_comm.Get_rank(),
            size=mpi_comm.Get_size(),
            local_rank=node.Get_rank(),
            local_size=node.Get_size(),
            timeout=timeout,
            debug=debug,
        )
        node.Free()
        self.mpi_comm = mpi_comm
        self.cuda_aware = cuda_aware()
        self._progress = WindowBoard(mpi_comm)

    @property
    def engine(self) -> str:
        return library_version()

    def _board(self) -> ProgressBoard:
        return self._progress

    # Device handling: CUDA tensors go straight to a CUDA-aware MPI, else through a host copy.
    def _host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t
        if self.cuda_aware and t.device.type == "cuda":
            torch.cuda.current_stream(t.device).synchronize()
            return t
        return t.cpu()

    def _work(self, op: str, seq: int, request: Any, finish: Callable[[], Any]) -> Work:
        return Work(self, op, seq, request.Test, finish)

    def _allreduce(self, t: torch.Tensor, op: str, seq: int) -> Work:
        host = self._host(t)
        wire = host.float() if t.dtype in _HALF else host
        request = self.mpi_comm.Iallreduce(
            MPI.IN_PLACE, _buffer(wire, _move_type(wire, "allreduce")), _reduce_op(wire, op)
        )

        def finish() -> torch.Tensor:
            if op == "avg":
                wire.div_(self.size)
            if wire is not t:
                t.copy_(wire)
            return t

        return self._work("allreduce", seq, request, finish)

    def _allgather(self, t: torch.Tensor, sizes: list[int], seq: int) -> Work:
        host = self._host(t)
        row = int(torch.Size(t.shape[1:]).numel())
        out_host = torch.empty((sum(sizes), *t.shape[1:]), dtype=t.dtype, device=host.device)
        dtype = _move_type(t, "allgather")
        if len(set(sizes)) == 1:
            request = self.mpi_comm.Iallgather(_buffer(host, dtype), _buffer(out_host, dtype))
        else:
            counts = [n * row for n in sizes]
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
            request = self.mpi_comm.Iallgatherv(_buffer(host, dtype), [_memory(out_host), counts, displs, dtype])

        def finish() -> torch.Tensor:
            return out_host if out_host.device == t.device else out_host.to(t.device)

        return self._work("allgather", seq, request, finish)

    def _reduce_scatter(self, t: torch.Tensor, op: str, seq: int) -> Work:
        host = self._host(t)
        wire = host.float() if t.dtype in _HALF else host
        out = torch.empty((t.shape[0] // self.size, *t.shape[1:]), dtype=wire.dtype, device=wire.device)
        dtype = _move_type(wire, "reduce_scatter")
        request = self.mpi_comm.Ireduce_scatter_block(_buffer(wire, dtype), _buffer(out, dtype), _reduce_op(wire, op))

        def finish() -> torch.Tensor:
            if op == "avg":
                out.div_(self.size)
            return out.to(device=t.device, dtype=t.dtype)

        return self._work("reduce_scatter", seq, request, finish)

    def _broadcast(self, t: torch.Tensor, root: int, seq: int) -> Work:
        host = self._host(t)
        request = self.mpi_comm.Ibcast(_buffer(host, _move_type(t, "broadcast")), root=root)
        return self._work("broadcast", seq, request, lambda: _copy_back(t, host))

    def _alltoall(self, t: torch.Tensor, seq: int) -> Work:
        host = self._host(t)
        out = torch.empty_like(host)
        dtype = _move_type(t, "alltoall")
        request = self.mpi_comm.Ialltoall(_buffer(host, dtype), _buffer(out, dtype))
        return self._work("alltoall", seq, request, lambda: out.to(t.device))

    def _barrier(self, seq: int) -> Work:
        return self._work("barrier", seq, self.mpi_comm.Ibarrier(), lambda: None)

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> Work:
        host = self._host(t)
        request = self.mpi_comm.Isend(_buffer(host, _move_type(t, "send")), dest=dst, tag=tag)
        return self._work(f"send to {dst}", -1, request, lambda: t)

    def _recv(self, t: torch.Tensor, src: int, tag: int) -> Work:
        host = self._host(t)
        request = self.mpi_comm.Irecv(_buffer(host, _move_type(t, "recv")), source=src, tag=tag)
        return self._work(f"recv from {src}", -1, request, lambda: _copy_back(t, host))

    def _split(self, color: Optional[int], key: int, seq: int) -> Optional[Communicator]:
        # Agree on the split with a bounded collective first, so that a missing rank
        # is a timeout error rather than a hang inside MPI_Comm_split.
        self._barrier(seq).wait()
        child = self.mpi_comm.Split(MPI.UNDEFINED if color is None else color, key)
        if child == MPI.COMM_NULL:
            return None
        return MpiCommunicator(child, timeout=self.timeout, debug=self.debug)

    def _close(self) -> None:
        # Freeing the window waits for every rank: meet at a bounded barrier first,
        # and leave the resources to the process exit if someone does not come.
        self._exit_barrier()
        if self._broken:
            return  # collectives may be pending; freeing would wait on them
        self._progress.close()
        if self.mpi_comm != MPI.COMM_WORLD:
            self.mpi_comm.Free()


def _copy_back(t: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    if host is not t:
        t.copy_(host)
    return t


def node_comm(mpi_comm: Any) -> Any:
    """The ranks of `mpi_comm` that share this node's memory (caller frees it).

    HPDL_RANKS_PER_NODE=k cuts each node into virtual nodes of k ranks, so
    that multi-node code paths can be tested on one machine.
    """
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
    per_node = os.environ.get("HPDL_RANKS_PER_NODE")
    if not per_node:
        return node
    try:
        k = int(per_node)
    except ValueError:
        raise ValueError(f"HPDL_RANKS_PER_NODE={per_node!r} must be a positive int") from None
    if k <= 0:
        raise ValueError(f"HPDL_RANKS_PER_NODE={per_node!r} must be a positive int")
    virtual = node.Split(node.Get_rank() // k, node.Get_rank())
    node.Free()
    return virtual
