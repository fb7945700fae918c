"""The `mpi` backend: collectives on torch tensors through mpi4py, without copies.

Contiguous CPU tensors go to MPI as raw memory (address, count, datatype),
so no pickling and no copy. float16 and bfloat16 have no MPI datatype:
they move as 16-bit words and are reduced in float32. GPU tensors go to MPI
directly when the library is CUDA-aware (`cuda_aware()`), else they are
staged through host memory. Every call is non-blocking underneath, so every
wait can time out. On two ranks collectives travel as one message each way,
on 4, 8, ... ranks a small allreduce as recursive doubling (pairs.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import threading
import time
import types
import weakref
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from hpdl.comm import agreement, fusion, mpi_calls, pairs, same_settings, shm
from hpdl.comm import tuning as tuning_file
from hpdl.comm.base import DECLINED, Communicator, is_block_of, own_op
from hpdl.comm.env import env_flag, env_number
from hpdl.comm.progress import OP_CODES, OP_NAMES, ProgressBoard, State, describe_laggards, mismatched
from hpdl.comm.work import Work, completed, poll_until
from hpdl.errors import BackendUnavailableError, CommError, CommTimeoutError

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

_NATIVE = {dtype: mpi for dtype, mpi in _MOVE_TYPES.items() if dtype not in (torch.float16, torch.bfloat16, torch.bool)}
"""dtypes whose MPI datatype reduces them directly (16-bit floats go through float32, bool through LOR/LAND)."""
_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
_BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "prod": MPI.LAND}
_HALF = (torch.float16, torch.bfloat16)


def library_version() -> str:
    """The MPI library's name and version from its own version text (for example 'MPICH 5.0.2')."""
    first = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]  # Open MPI's ends in a NUL
    return " ".join(first.replace("Version:", "").split())


def cuda_aware() -> bool:
    """Whether the MPI library accepts CUDA device pointers (HPDL_MPI_CUDA_AWARE=0/1 overrides)."""
    if os.environ.get("HPDL_MPI_CUDA_AWARE") is not None:
        return env_flag("HPDL_MPI_CUDA_AWARE")
    open_mpi = MPI.get_vendor()[0] == "Open MPI"
    for path in _loaded_mpi_libraries():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "ompi_mpi_comm_self") != open_mpi:
            # another MPI mapped beside the running one (hpdl's compiled calls, linked to it, stood aside): asked, an
            # uninitialised MPICH ends the process ("Attempting to use an MPI routine before initializing")
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
    return mpi_calls.memory_at(t.data_ptr(), t.numel() * t.element_size())


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


class MpiCommunicator(Communicator):
    """A communicator over an mpi4py `Comm` (COMM_WORLD or one made by `split`)."""

    backend = "mpi"

    def __init__(
        self,
        mpi_comm: Any,
        *,
        timeout: float,
        debug: bool,
        tuning: Optional[tuning_file.Tuning] = None,
        read_tuning: bool = False,
    ):
        """`tuning`: the shared-memory thresholds measured by `hpdl tune` (a parent's, for a split); with
        `read_tuning` rank 0 reads them from the file and every rank takes its answer (hpdl.init's world)."""
        node = node_comm(mpi_comm)
        super().__init__(
            rank=mpi_comm.Get_rank(),
            size=mpi_comm.Get_size(),
            local_rank=node.Get_rank(),
            local_size=node.Get_size(),
            timeout=timeout,
            debug=debug,
        )
        local_size = node.Get_size()
        node.Free()
        self.mpi_comm = mpi_comm
        self.cuda_aware = cuda_aware()
        self._progress = WindowBoard(mpi_comm, timeout)  # returns once every rank has started
        try:
            self._tuning = tuning_file.agree(mpi_comm, timeout) if read_tuning else tuning
        except Exception:
            self._progress.close()  # every rank raises the same error: leave MPI as hpdl.init found it
            raise
        self.shared_memory = shm.enabled()
        """Use the shared-memory path inside the node (HPDL_SHM); set before the first large collective."""
        # Read once: this is consulted on every collective.
        try:
            if self._tuning is not None:  # every rank must look up the same entry
                local_size = tuning_file.uniform_node_size(mpi_comm, local_size, timeout)
            measured, self.shm_thresholds_source = tuning_file.thresholds_for(
                self._tuning, local_size, library_version()
            )
            """Where the shared-memory thresholds come from: `hpdl tune`'s file, or built in (and why)."""
            self._pair_limits = pairs.limits(self.size)
            """Per collective, the bytes each way below which it travels as messages (pairs.py)."""
            built_in = self.shm_thresholds_source.startswith("built-in")
            self._shm_thresholds = {
                op: shm.thresholds(op, measured[op], built_in and self._pair_limits[op] >= pairs.ANY_SIZE)
                for op in shm.DEFAULT_THRESHOLDS
            }
            self._fused_shm_min = shm.fused_threshold()
            self._counted_reduce_scatter = mpi_calls.counted_reduce_scatter(library_version())
            """Input bytes [from, to) where reduce_scatter calls MPI_Ireduce_scatter, not ..._block."""
            same_settings.agree(mpi_comm, self._path_settings(), timeout)
        except Exception:
            self._progress.close()  # every rank raises the same error: leave MPI as it was
            raise
        self._exit_comm = mpi_comm.Dup()
        """Where the exit barrier meets: MPI pairs nonblocking collectives by order alone, so on `mpi_comm` a
        rank still inside a collective would take the others' exit barrier for it (and return garbage)."""
        self._check_comm = mpi_comm.Dup()
        """Where the agreement check's vote and exchange of rings meet (`_vote`, `_vote_gather`): on `mpi_comm` (or
        the pair's messages) a rank in the check takes a peer's user collective of the same size for its vote, and
        each returns the other's bytes; a rank that skipped a collective was then reported as an allgather of the
        check's rings (1536 B) that the user never called. Here the check meets only the check: a rank that waits
        in it while a peer waits in a user collective reads on the progress board what each called."""
        self._node: Optional[shm.NodeCollectives] = None
        self._cross: Any = None
        self._hand_back: Optional[tuple[int, list[Work]]] = None
        """Set by `start_briefly`: where the fast paths put an operation still running after their short wait."""
        self._pair: Any = None
        self._open_shm_gates()
        calls, self.calls = mpi_calls.select()
        """Which MPI calls the fast paths make: compiled (hpdl.comm._mpi_fast) or mpi4py's, and why."""
        self._fast = FastTables(calls)
        self._fast_allreduce = self._fast.allreduce
        self._fast_reduce_scatter = self._fast.reduce_scatter
        self._fast_move = self._fast.move
        self._fast_broadcast = self._fast.broadcast
        self._handle = calls.handle(mpi_comm)
        self._check_handle = calls.handle(self._check_comm)
        self._call_allreduce = calls.allreduce
        self._call_allgather = calls.allgather
        self._call_reduce_scatter = calls.reduce_scatter
        self._call_broadcast = calls.broadcast
        self._call_send = calls.send
        self._call_recv = calls.recv
        self._calls = calls
        self._handle_of = calls.handle
        self._probe_first = pairs.probe_first(library_version())
        """Receive only once a matched probe told the message's length (outside MPICH: see pairs.probe_first)."""
        if any(self._pair_limits.values()):
            self._start_pair(calls)
        self._slots = self._progress.slots
        self._status = MPI.Status()
        self.shm_status = "not started (starts with the first collective above its size threshold)"
        if calls.compiled:
            self._compile_blocking_paths(calls)

    def _compile_blocking_paths(self, calls: mpi_calls.Calls) -> None:
        """Route this communicator's allreduce, allgather, reduce_scatter and broadcast through the compiled
        `Fast` (_mpi_fast.c): the blocking fast paths below without a Python frame, the same checks, numbering,
        progress post and agreement entry; every call it does not take goes to the Python method unchanged.

        A method that is no longer the one this module defined (a subclass's, or wrapped on the class by
        instrumentation such as the hybrid benchmark's byte counter) is left alone: it keeps every call."""
        names = _COMPILED_PATHS
        fast = calls.module.Fast(
            self, self._handle, self.rank, self.size, self._progress.address, _Tensor,
            tuple(OP_CODES[name] for name in names), tuple(types.MethodType(_DEFINED[name], self)
            for name in names), self._fast_slow, functools.partial(agreement.check, self),
        )  # fmt: skip
        ops = [op for op in _OPS if op != "avg"]  # avg divides after the call: the Python path; "sum" first
        for op in ops:
            fast.add_op(op, calls.handle(_OPS[op]))
        roots = range(min(self.size, 64))
        for dtype, mpi_type in _MOVE_TYPES.items():
            name = agreement.dtype_name(dtype)
            fast.add_dtype(
                dtype, calls.handle(mpi_type), torch.empty((), dtype=dtype).element_size(), self._fast_move[dtype][1],
                [self._fast_allreduce.get((dtype, op), _NOT_FAST)[2] for op in ops],
                [self._fast_reduce_scatter.get((dtype, op), _NOT_FAST)[2] for op in ops],
                [agreement.code("broadcast", name, f"root={root}") for root in roots],
            )  # fmt: skip
        for name in names:
            if getattr(type(self), name) is _DEFINED[name]:
                setattr(self, name, getattr(fast, name))

    def _start_pair(self, calls: mpi_calls.Calls) -> None:
        """Two ranks: the small collectives' messages, on a duplicate of the communicator; every fast path's MPI
        call goes through the routing below (the compiled `Fast` reads `_pair` itself)."""
        span = (MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767) + 1  # (a predefined attribute of COMM_WORLD only)
        mismatch = functools.partial(_pair_mismatch, weakref.ref(self))  # (the pair must not keep this alive)
        pair_type = calls.module.Pair if calls.compiled else pairs.Pair
        self._pair = pair_type(self.mpi_comm.Dup(), self.rank, self.size, span, mismatch, self._probe_first)
        self._call_allreduce = self._routed_allreduce
        self._call_allgather = self._routed_allgather
        self._call_reduce_scatter = self._routed_reduce_scatter
        self._call_broadcast = self._routed_broadcast
        self._open_shm_gates()

    # The fast paths' MPI calls on a two-rank communicator: messages below the pair's limits, the collective
    # from there (bytes each way: the allreduce's or broadcast's buffer, an allgather's or reduce_scatter's
    # block per rank, as the compiled `Fast` compares).
    def _routed_allreduce(self, comm: Any, address: int, nbytes: int, datatype: Any, op: Any, wait: float) -> Any:
        if nbytes < self._pair_allreduce_below and comm == self._handle:
            return self._pair.allreduce(address, nbytes, datatype, op, wait)
        return self._calls.allreduce(comm, address, nbytes, datatype, op, wait)

    def _routed_allgather(self, comm: Any, send: int, out: int, nbytes: int, datatype: Any, wait: float) -> Any:
        if nbytes < self._pair_allgather_below and comm == self._handle:
            return self._pair.allgather(send, out, nbytes, datatype, wait)
        return self._calls.allgather(comm, send, out, nbytes, datatype, wait)

    def _routed_reduce_scatter(
        self, comm: Any, address: int, out: int, nbytes: int, datatype: Any, op: Any, wait: float
    ) -> Any:  # fmt: skip
        if nbytes < self._pair_reduce_scatter_below and comm == self._handle:
            return self._pair.reduce_scatter(address, out, nbytes, datatype, op, wait)
        return self._calls.reduce_scatter(comm, address, out, nbytes, datatype, op, wait)

    def _routed_broadcast(self, comm: Any, address: int, nbytes: int, datatype: Any, root: int, wait: float) -> Any:
        if nbytes < self._pair_broadcast_below and comm == self._handle:
            return self._pair.broadcast(address, nbytes, datatype, root, wait)
        return self._calls.broadcast(comm, address, nbytes, datatype, root, wait)

    @property
    def pairs(self) -> str:
        """Which collectives travel as messages (pairs.py), in words."""
        return pairs.describe(self._pair_limits if self._pair is not None else dict.fromkeys(pairs.KINDS, 0))

    def _path_settings(self) -> dict[str, int]:
        """What decides, per call, which path a collective takes and how: every rank must read the same."""
        settings = {
            "HPDL_DEBUG": int(self._debug),
            "HPDL_CHECK_EVERY": self.check_every,
            "HPDL_SHM": int(self.shared_memory),
            "HPDL_SHM_MB (bytes)": shm.segment_bytes(),
            "HPDL_SHM_PIECE_MB (bytes)": shm.piece_bytes(),
            "HPDL_SHM_MIN_ALLREDUCE_COALESCED": self._fused_shm_min,
            "HPDL_FUSION_MB (bytes)": fusion.bucket_bytes(None),
            "HPDL_COUNTED_REDUCE_SCATTER (from)": self._counted_reduce_scatter[0],
            "HPDL_COUNTED_REDUCE_SCATTER (to)": self._counted_reduce_scatter[1],
        }
        for op, below in self._pair_limits.items():
            settings[f"HPDL_PAIR_BYTES ({op})"] = below
        for op, (zero_copy, ordinary) in self._shm_thresholds.items():
            settings[f"HPDL_SHM_MIN_{op.upper()} (shared buffers)"] = zero_copy
            settings[f"HPDL_SHM_MIN_{op.upper()} (ordinary tensors)"] = ordinary
        return settings

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

    def _open_shm_gates(self, closed: bool = False) -> None:
        """Per operation, the smallest message that may take the shared-memory path (every fast path compares its
        own: one op's low threshold must not send another op's small messages down the general path). The lower
        threshold (zero copy) only counts once shared buffers exist: until then no call can be zero-copy, and
        ordinary tensors up to the higher one keep the fast path."""
        buffers = self._node is not None and self._node.has_buffers
        gate = {
            op: math.inf if closed else float(low if buffers else high)
            for op, (low, high) in self._shm_thresholds.items()
        }
        self._shm_smallest = min(gate.values())
        # Two ranks: below these, messages (pairs.py), never on the exit channel. The fast paths stop at the
        # gates; past them a call the shared-memory engine does not take (an ordinary tensor between the
        # thresholds) goes as messages from the general path too.
        paired = self._pair is not None and not closed
        limit = self._pair_limits
        self._pair_allreduce_below = limit["allreduce"] if paired else 0
        self._pair_allgather_below = limit["allgather"] if paired else 0
        self._pair_reduce_scatter_below = limit["reduce_scatter"] if paired else 0
        self._pair_broadcast_below = limit["broadcast"] if paired else 0
        # The fast paths also leave messages that need more than an int count to the general path.
        self._fast_allreduce_below = min(gate["allreduce"], _INT_COUNT)
        self._fast_allgather_below = min(gate["allgather"], _INT_COUNT)
        # The counted reduce_scatter's window is the general path's, unless messages cover it (two ranks: 2 MiB
        # of input took 278 us through the general path's Python wait, 210 us on the fast path).
        low, high = self._counted_reduce_scatter
        covered = self._pair_reduce_scatter_below * self.size >= min(high, gate["reduce_scatter"])
        window = low if low < high and not covered else math.inf
        self._fast_reduce_scatter_below = min(gate["reduce_scatter"], _INT_COUNT, window)
        self._fast_broadcast_below = min(gate["broadcast"], _INT_COUNT)

    # ------------------------------------------------------------------ fast paths
    # The common call on an ordinary contiguous CPU tensor below the shared-memory thresholds,
    # with debug and tracing off: the same checks, numbering, progress post and agreement
    # signature as the general path (base.Communicator), with what can be cached cached per
    # (dtype, op). A blocking call builds no Work object, closure or list unless the engine is
    # still busy after the first test; a non-blocking one (DataParallel's buckets, the torch
    # backend's every call) gets the same Work the general path would give, without the
    # general path's per-call lookups. Anything else takes the general path.
    def allreduce(self, tensor: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        if type(tensor) is _Tensor and self._plain:
            spec = self._fast_allreduce.get((tensor.dtype, op))
            if spec is not None and tensor.is_cpu and tensor.is_contiguous():
                nbytes = tensor.nbytes
                if nbytes < self._fast_allreduce_below:
                    seq = self._seq = self._seq + 1
                    slots = self._slots
                    slots[0] = seq
                    slots[1] = _ALLREDUCE
                    every = self._every
                    if every:
                        self._ring[seq % every] = spec[2] | nbytes << 32 | 1 << 80  # agreement.entry
                        if not seq % every:
                            agreement.check(self, seq)
                    try:
                        request = self._call_allreduce(
                            self._handle, tensor.data_ptr(), nbytes, spec[0], spec[1], _NO_WAIT if async_op else _WAIT
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
        if out is None and type(tensor) is _Tensor and type(sizes) in _SEQUENCES and self._plain:
            shape = tensor.shape  # equal sizes and no `out` (torch's list all_gather): the new tensor made here
            if shape and len(sizes) == self.size and sizes.count(shape[0]) == self.size and tensor.is_cpu:
                out = torch.empty((shape[0] * self.size, *shape[1:]), dtype=tensor.dtype)
                sizes = None  # (checked: with `out`, no sizes means every rank's dim 0 equals this one's)
        # (with `out` and no `sizes` every rank's dim 0 is taken to equal this rank's, as the general path takes it)
        if type(tensor) is _Tensor and type(out) is _Tensor and (sizes is None or type(sizes) in _SEQUENCES) and (
            self._plain
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
                if nbytes * size < self._fast_allgather_below:
                    seq = self._seq = self._seq + 1
                    slots = self._slots
                    slots[0] = seq
                    slots[1] = _ALLGATHER
                    every = self._every
                    if every:
                        row = nbytes // shape[0] if shape[0] else tensor.element_size() * math.prod(shape[1:])
                        self._ring[seq % every] = spec[1] | row << 32 | (shape[0] * size + 1) << 80
                        if not seq % every:
                            agreement.check(self, seq)
                    try:
                        request = self._call_allgather(
                            self._handle, 0 if in_place else mine, at, nbytes, spec[0],
                            _NO_WAIT if async_op else _WAIT,
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
        spec = self._fast_move.get(torch.int64)
        if spec is None or not self._plain:
            return super()._exchange_sizes(t, seq)
        mine = torch.tensor([t.shape[0], math.prod(t.shape[1:])], dtype=torch.int64)
        table = torch.empty(2 * self.size, dtype=torch.int64)
        try:
            request = self._call_allgather(self._handle, mine.data_ptr(), table.data_ptr(), 16, spec[0], _WAIT)
            if request is not None:
                Work(self, "allgather", seq, request.Test, keep=(mine, table)).wait()
        except MPI.Exception as exc:
            raise self._engine_error("allgather", seq, exc) from exc
        return self._sizes_of(table.tolist())

    def reduce_scatter(self, tensor: Any, op: str = "sum", *, out: Any = None, async_op: bool = False) -> Any:
        if type(tensor) is _Tensor and self._plain and (out is None or type(out) is _Tensor):
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
                if nbytes < self._fast_reduce_scatter_below:
                    seq = self._seq = self._seq + 1
                    slots = self._slots
                    slots[0] = seq
                    slots[1] = _REDUCE_SCATTER
                    every = self._every
                    if every:
                        self._ring[seq % every] = spec[2] | nbytes << 32 | 1 << 80
                        if not seq % every:
                            agreement.check(self, seq)
                    try:
                        request = self._call_reduce_scatter(
                            self._handle, mine, at, nbytes // size, spec[0], spec[1],
                            _NO_WAIT if async_op else _WAIT,
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
        if type(tensor) is _Tensor and type(root) is int and self._plain:  # (True or np.int64(1) would match 1)
            spec = self._fast_broadcast.get((tensor.dtype, root))
            if spec is None and 0 <= root < self.size:
                spec = self._fast.add_broadcast(tensor.dtype, root)
            if spec is not None and tensor.is_cpu and tensor.is_contiguous():
                nbytes = tensor.nbytes
                if nbytes < self._fast_broadcast_below:
                    seq = self._seq = self._seq + 1
                    slots = self._slots
                    slots[0] = seq
                    slots[1] = _BROADCAST
                    every = self._every
                    if every:
                        self._ring[seq % every] = spec[1] | nbytes << 32 | 1 << 80
                        if not seq % every:
                            agreement.check(self, seq)
                    try:
                        request = self._call_broadcast(
                            self._handle, tensor.data_ptr(), nbytes, spec[0], root, _NO_WAIT if async_op else _WAIT
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
        if type(tensor) is _Tensor and type(dst) is int and self._plain and not async_op:
            spec = self._fast_move.get(tensor.dtype)
            if (
                spec is not None and 0 <= dst < self.size and dst != self.rank
                and tensor.is_cpu and tensor.is_contiguous() and tensor.nbytes < _INT_COUNT
            ):  # fmt: skip
                try:
                    request = self._call_send(self._handle, tensor.data_ptr(), tensor.nbytes, spec[0], dst, tag, _WAIT)
                    if request is not None:
                        Work(self, f"send to {dst}", -1, request.Test, keep=tensor).wait()
                except MPI.Exception as exc:
                    raise self._engine_error(f"send to {dst}", -1, exc) from exc
                return tensor
        return super().send(tensor, dst, tag=tag, async_op=async_op)

    def recv(self, tensor: Any, src: Optional[int], *, tag: int = 0, async_op: bool = False) -> Any:
        if type(tensor) is _Tensor and type(src) is int and self._plain and not async_op and not self._probe_first:
            spec = self._fast_move.get(tensor.dtype)
            if (
                spec is not None and 0 <= src < self.size and src != self.rank
                and tensor.is_cpu and tensor.is_contiguous() and tensor.nbytes < _INT_COUNT
            ):  # fmt: skip
                nbytes = tensor.nbytes
                try:
                    got = self._call_recv(self._handle, tensor.data_ptr(), nbytes, spec[0], src, tag, _WAIT)
                    if type(got) is not int:
                        status = self._status
                        Work(self, f"recv from {src}", -1, lambda: got.Test(status), keep=tensor).wait()
                        got = status.Get_count(_BYTE)
                except MPI.Exception as exc:
                    raise _recv_error(exc, src, tag, tensor) from None
                if got != nbytes:
                    raise _short_message(got, src, tag, tensor)
                return tensor
        return super().recv(tensor, src, tag=tag, async_op=async_op)

    def start_briefly(self, op: str, tensor: torch.Tensor, arg: Any) -> Any:
        """The fast path's blocking call, compiled where built, with the fast path's own short wait (`_WAIT`) and
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

    def _vote(self, vote: torch.Tensor, seq: int) -> None:
        """The agreement check's 16-byte MAX through the fast path's call, on the check's own communicator (see
        `_check_comm`; an MPI_Iallreduce there every `check_every` collectives: 0.4 us more than the pair's
        messages on 2 ranks, 0.03 us a call)."""
        try:
            request = self._calls.allreduce(
                self._check_handle, vote.data_ptr(), 16, *self._fast_allreduce[_VOTE][:2], _WAIT
            )
            if request is not None:
                Work(self, "allreduce", seq, request.Test, keep=vote).wait()
        except MPI.Exception as exc:
            raise self._engine_error("allreduce", seq, exc) from exc

    def _vote_gather(self, t: torch.Tensor, seq: int) -> torch.Tensor:
        out = torch.empty(t.numel() * self.size, dtype=t.dtype)
        request = self._check_comm.Iallgather(_buffer(t, MPI.BYTE), _buffer(out, MPI.BYTE))
        return self._work("allgather", seq, request, lambda: out, t, out).wait()

    def _engine_error(self, op: str, seq: int, exc: Exception) -> Exception:
        """MPI's own error while an operation completes, said in terms of what the caller can fix."""
        if not isinstance(exc, MPI.Exception):
            return exc
        what = op if seq < 0 else f"{op} #{seq}"
        stack = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return CommError(
            f"{what} failed in MPI on rank {self.rank} of {self.size} ({MPI.Get_error_string(exc.Get_error_class())}"
            f": {stack[-1] if stack else exc}). With matching calls MPI does not fail here: the usual cause is ranks "
            "that passed different sizes, dtypes, roots or ops to this operation (MPI compares none of them; hpdl's "
            "agreement check would have named them at its next check); a rank that died is the other. Run with "
            "HPDL_DEBUG=1 to compare every rank's call before it runs."
        )

    # Shared memory inside the node (see shm.py): started at the first large collective,
    # which every rank reaches with the same size, so the collective set-up is reached together.
    def _shared_memory(self, op: str, nbytes: int, t: torch.Tensor, called: str = "") -> Optional[shm.NodeCollectives]:
        """The node's shared-memory engine when `op` on `t` should use it (the same answer on every rank).

        Ordinary tensors of at least the larger threshold always go through it
        (copied in); between the thresholds only when every rank's tensor is
        already in a shared window (zero copy), which the ranks agree on first.
        `called`: what the caller called, for the engine's start-up error, when it is not `op`.
        """
        if nbytes < self._shm_smallest:
            return None
        with_buffers, ordinary = self._shm_thresholds[op]
        if nbytes < with_buffers or not t.is_cpu:
            return None
        if nbytes < ordinary and (self._node is None or not self._node.has_buffers):
            return None
        if self._node is None and self.shm_status.startswith("not started"):
            self._start_shared_memory(called or op)
        if self._node is None or (self._cross is not None and op != "allreduce"):
            return None  # across nodes only the allreduce is hierarchical; the rest stay with MPI
        if nbytes < ordinary and not self._node.all_zero_copy(t):
            return None
        return self._node

    def _start_shared_memory(self, op: str) -> None:
        self.shm_status = "starting"  # the set-up's own small collectives go through MPI
        # Every rank must be here before the unbounded MPI set-up calls below.
        try:
            self._barrier(self._seq).wait()
        except CommTimeoutError as exc:  # said as the caller's collective, which this barrier starts
            raise CommTimeoutError(
                f"{exc} This barrier starts the node's shared-memory engine at {op} #{self._seq}, the first "
                "collective above its size threshold on this communicator: every rank must make the same call "
                "here.",
                op=op,
                seq=self._seq,
                missing=exc.missing,
            ) from None
        node = node_comm(self.mpi_comm)
        local = node.Get_size()
        wanted = int(self.shared_memory)
        free = shm.available_bytes()
        free = shm.NEVER if free is None else free
        extremes = torch.tensor([local, -local, -wanted, -free], dtype=torch.int64)  # max, -min, -min, -min
        self._allreduce(extremes, "max", -1).wait()
        free = -int(extremes[3])  # the least any rank sees (the same directory on a node; nodes may differ)
        segment = shm.fitting_segment(shm.segment_bytes(), free, local)
        if extremes[2] != -1:  # off on at least one rank: off everywhere
            self.shm_status = "off (HPDL_SHM=0 or comm.shared_memory = False): plain MPI"
        elif local == 1:
            self.shm_status = "off: one rank on this node, plain MPI"
        elif int(extremes[0]) != -int(extremes[1]):
            self.shm_status = "off: nodes hold different numbers of ranks, plain MPI"
        elif not segment:
            self.shm_status = f"off: {shm.short_of_shared_memory(free)}; plain MPI"
        else:
            members = node.Get_group().Translate_ranks(list(range(local)), self.mpi_comm.Get_group())
            try:
                self._node = shm.NodeCollectives(
                    node, members, lambda: self.timeout, self.__repr__, self._mark_broken, segment=segment,
                    watch=self._watch_in_node, positions=self._positions_in_node,
                )  # fmt: skip
            except MPI.Exception as exc:
                self.shm_status = f"off: shared window could not be allocated ({exc}), plain MPI"
            else:
                nodes = self.size // local
                if nodes > 1:
                    self._cross = self.mpi_comm.Split(node.Get_rank(), self.rank)
                self.shm_status = (
                    f"on: {local} ranks per node share {segment / 2**20:.3g} MB each"
                    + (
                        f", not {shm.segment_bytes() / 2**20:.3g}: {shm.short_of_shared_memory(free)}"
                        if segment < shm.segment_bytes()
                        else ""
                    )
                    + (f"; hierarchical allreduce across {nodes} nodes" if nodes > 1 else "")
                )
                return
        node.Free()

    def _mark_broken(self) -> None:
        self._broken = True

    def _watch_in_node(self) -> None:
        """The shared-memory engine's look at the peers while a meeting waits: as `Work.wait`'s (the collective is
        this rank's latest, and its progress post says which op it is)."""
        self._check_peers("", self._seq)

    def _positions_in_node(self) -> str:
        """Where every rank is, for the shared-memory engine's timeout error (as `_timeout_error` says it)."""
        states = self._progress.read(min(2.0, self.timeout))
        return describe_laggards(states, self.rank, self._seq, own_op(states, self.rank, self._seq, ""))[0]

    def _across_nodes(self, t: torch.Tensor, op: str) -> None:
        """Allreduce one node-reduced slice among the ranks with this local rank on every node."""
        request = self._cross.Iallreduce(MPI.IN_PLACE, _buffer(t, _move_type(t, "allreduce")), _reduce_op(t, op))
        Work(self, "allreduce (across nodes)", self._seq, request.Test).wait()

    def shared_buffer(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        node = self._shared_memory("allreduce", shm.NEVER, torch.empty(0), called="shared_buffer")
        if node is None:
            return super().shared_buffer(numel, dtype)
        made = node.shared_buffer(numel, dtype)
        self._open_shm_gates()  # zero-copy sizes now leave the fast paths (every rank made one)
        return made

    def peer_buffer(self, buffer: torch.Tensor, rank: int) -> Optional[torch.Tensor]:
        if self._node is None or rank not in self._node.ranks:
            return None
        return self._node.peer_view(buffer, self._node.ranks.index(rank))

    def fence_shared(self) -> None:
        if self._node is not None:
            self._node.fence()

    def _use_shm_thresholds(self, op: str, zero_copy: int, ordinary: int) -> None:
        """Where `op` takes the shared-memory path from now on (bytes: shared buffers, ordinary tensors), as
        `hpdl tune` does to time each path. Every rank must set the same numbers before its next `op`."""
        self._shm_thresholds[op] = (zero_copy, ordinary)
        self._open_shm_gates()

    @property
    def engine(self) -> str:
        return library_version()

    def _board(self) -> ProgressBoard:
        return self._progress

    # Device handling: CUDA tensors go straight to a CUDA-aware MPI, else through a host copy.
    def _host(self, t: torch.Tensor, messages: bool = False) -> torch.Tensor:
        """`messages`: for a pair's exchange (pairs.py), always host memory: MPI_Reduce_local reduces on the CPU."""
        if t.device.type == "cpu":
            return t
        if self.cuda_aware and t.device.type == "cuda" and not messages:
            torch.cuda.current_stream(t.device).synchronize()
            return t
        return t.cpu()

    def _work(self, op: str, seq: int, request: Any, finish: Callable[[], Any], *keep: Any) -> Work:
        """A handle on an MPI request; `keep` holds the buffers MPI uses (it has only their addresses)."""
        return Work(self, op, seq, request.Test, finish, keep=keep)

    def _allreduce(self, t: torch.Tensor, op: str, seq: int) -> Work:
        if node := self._shared_memory("allreduce", t.numel() * t.element_size(), t):
            node.allreduce(t, op, self._across_nodes if self._cross is not None else None)
            if op == "avg":
                t.div_(self.size)
            return completed(self, "allreduce", seq, t)
        if self._pair_allreduce_below and t.numel() * (4 if t.dtype in _HALF else t.element_size()) < (
            self._pair_allreduce_below
        ):
            return self._pair_allreduce(t, op, seq)
        if t.is_cpu and t.dtype in _NATIVE:  # the common case, kept short: it runs for every bucket
            request = self.mpi_comm.Iallreduce(MPI.IN_PLACE, [_memory(t), _NATIVE[t.dtype]], _OPS[op])
            average = (lambda: t.div_(self.size)) if op == "avg" else None
            return Work(self, "allreduce", seq, request.Test, average, keep=t)
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

    def _pair_allreduce(self, t: torch.Tensor, op: str, seq: int) -> Work:
        """A two-rank allreduce as messages (pairs.py): on the host, 16-bit floats in float32."""
        wire = self._host(t, messages=True)
        if t.dtype in _HALF:
            wire = wire.float()
        handle = self._handle_of
        request = self._pair.allreduce(
            wire.data_ptr(), wire.nbytes, handle(_move_type(wire, "allreduce")), handle(_reduce_op(wire, op)),
            _NO_WAIT,
        )  # fmt: skip

        def finish() -> torch.Tensor:
            if op == "avg":
                wire.div_(self.size)
            return _copy_back(t, wire)

        return Work(self, "allreduce", seq, request.Test, finish, keep=wire)

    def _allreduce_buckets(
        self, buckets: list[fusion.Bucket], op: str, seq: int, async_op: bool
    ) -> tuple[list[Work], list[fusion.Bucket]]:
        """A blocking caller's buckets from `shm.fused_threshold()` go through shared memory straight from and into
        their tensors (no flat buffer: two copies of everything less); the others are packed for MPI. Every
        bucket that travels in its flat buffer is packed before any result is written back, as on MPI alone (a
        tensor given twice, or overlapping another, is read once, before it changes)."""
        nodes = [None if async_op else self._shared_memory_for_bucket(bucket) for bucket in buckets]
        for bucket, node in zip(buckets, nodes):
            if node is None or not bucket.packs_ranges:
                bucket.fill()
        across = self._across_nodes if self._cross is not None else None
        divisor = self.size if op == "avg" else 1
        packed = []
        for bucket, node in zip(buckets, nodes):
            if node is None:
                packed.append(bucket)
            elif bucket.packs_ranges:
                node.allreduce_packed(bucket, op, across, divisor)
            else:  # not compiled, or tensors autograd tracks or that share memory: the route through the flat buffer
                node.allreduce(bucket.flat, op, across, divisor)
                bucket.unpack()
        works = self._allreduce_flat([bucket.flat for bucket in packed], op, seq, async_op)
        return works, packed

    def _shared_memory_for_bucket(self, bucket: fusion.Bucket) -> Optional[shm.NodeCollectives]:
        """The node's engine for a fusion bucket of several CPU tensors from the fused threshold (the same answer on
        every rank: it depends only on the call's sizes); one tensor alone is an ordinary allreduce."""
        if len(bucket.targets) < 2 or bucket.flat.nbytes < self._fused_shm_min or not bucket.flat.is_cpu:
            return None
        if self._node is None and self.shm_status.startswith("not started"):
            self._start_shared_memory("allreduce_coalesced")
        return self._node

    def _allreduce_flat(self, flats: list[torch.Tensor], op: str, seq: int, async_op: bool) -> list[Work]:
        """A blocking caller's fused buffers below the gates go through the fast path's call, and the last one
        is waited for there (in C without the GIL where compiled: 20-40 us less for 800 KB than a `Work`'s
        loop of tests); the others as for any caller."""
        if async_op or op == "avg":
            return super()._allreduce_flat(flats, op, seq, async_op)
        works = []
        last = flats[-1] if flats else None
        for flat in flats:
            spec = self._fast_allreduce.get((flat.dtype, op))
            nbytes = flat.nbytes
            if spec is None or not flat.is_cpu or nbytes >= self._fast_allreduce_below:
                works.append(self._allreduce(flat, op, seq))
                continue
            try:
                request = self._call_allreduce(
                    self._handle, flat.data_ptr(), nbytes, spec[0], spec[1], _WAIT if flat is last else _NO_WAIT
                )
            except MPI.Exception as exc:
                raise self._engine_error("allreduce_coalesced", seq, exc) from exc
            if request is None:
                works.append(completed(self, "allreduce_coalesced", seq, flat))
            else:
                works.append(Work(self, "allreduce_coalesced", seq, request.Test, keep=flat))
        return works

    def _allgather(self, t: torch.Tensor, sizes: list[int], seq: int, out: Optional[torch.Tensor] = None) -> Work:
        total = sum(sizes) * math.prod(t.shape[1:]) * t.element_size()
        if node := self._shared_memory("allgather", total, t):
            result = out if out is not None else torch.empty((sum(sizes), *t.shape[1:]), dtype=t.dtype)
            node.allgather(t, sizes, result)
            return completed(self, "allgather", seq, result)
        row = math.prod(t.shape[1:])
        paired = len(set(sizes)) == 1 and t.numel() * t.element_size() < self._pair_allgather_below
        host = self._host(t, messages=paired)
        out_host = _output(out, host, (sum(sizes), *t.shape[1:]), t.dtype)
        dtype = _move_type(t, "allgather")
        in_place = is_block_of(host, out_host, sum(sizes[: self.rank]))
        send = _IN_PLACE if in_place else _buffer(host, dtype)
        if paired:
            request = self._pair.allgather(
                0 if in_place else host.data_ptr(), out_host.data_ptr(), host.nbytes, self._handle_of(dtype),
                _NO_WAIT,
            )  # fmt: skip
        elif len(set(sizes)) == 1:
            request = self.mpi_comm.Iallgather(send, _buffer(out_host, dtype))
        else:
            counts = [n * row for n in sizes]
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
            request = self.mpi_comm.Iallgatherv(send, [_memory(out_host), counts, displs, dtype])

        return self._work("allgather", seq, request, lambda: _deliver(out_host, out, t.device), host)

    def _reduce_scatter(self, t: torch.Tensor, op: str, seq: int, out: Optional[torch.Tensor] = None) -> Work:
        if node := self._shared_memory("reduce_scatter", t.numel() * t.element_size(), t):
            result = out if out is not None else torch.empty((t.shape[0] // self.size, *t.shape[1:]), dtype=t.dtype)
            node.reduce_scatter(t, op, result)
            if op == "avg":
                result.div_(self.size)
            return completed(self, "reduce_scatter", seq, result)
        wire_bytes = t.numel() * (4 if t.dtype in _HALF else t.element_size())
        each_way = wire_bytes // self.size
        on_device = self.cuda_aware and t.device.type == "cuda"  # MPI reads it where it is; messages stage it
        paired = each_way < self._pair_reduce_scatter_below and (not on_device or each_way < _DEVICE_PAIR_BELOW)
        host = self._host(t, messages=paired)
        wire = host.float() if t.dtype in _HALF else host
        result = _output(out, wire, (t.shape[0] // self.size, *t.shape[1:]), wire.dtype)
        dtype = _move_type(wire, "reduce_scatter")
        low, high = self._counted_reduce_scatter
        if paired:
            request = self._pair.reduce_scatter(
                wire.data_ptr(), result.data_ptr(), result.nbytes, self._handle_of(dtype),
                self._handle_of(_reduce_op(wire, op)), _NO_WAIT,
            )  # fmt: skip
        elif low <= wire.nbytes < high:  # the same operation, through the call that is fast at these sizes
            count = result.numel()
            request = self.mpi_comm.Ireduce_scatter(
                _buffer(wire, dtype), _buffer(result, dtype), [count] * self.size, _reduce_op(wire, op)
            )
        else:
            request = self.mpi_comm.Ireduce_scatter_block(
                _buffer(wire, dtype), _buffer(result, dtype), _reduce_op(wire, op)
            )

        def finish() -> torch.Tensor:
            if op == "avg":
                result.div_(self.size)
            return _deliver(result, out, t.device, t.dtype)

        return self._work("reduce_scatter", seq, request, finish, wire)

    def _broadcast(self, t: torch.Tensor, root: int, seq: int) -> Work:
        if node := self._shared_memory("broadcast", t.numel() * t.element_size(), t):
            node.broadcast(t, root)
            return completed(self, "broadcast", seq, t)
        nbytes = t.numel() * t.element_size()
        if nbytes < self._pair_broadcast_below:
            host = self._host(t, messages=True)
            handle = self._handle_of(_move_type(t, "broadcast"))
            request = self._pair.broadcast(host.data_ptr(), nbytes, handle, root, _NO_WAIT)
        else:
            host = self._host(t)
            request = self.mpi_comm.Ibcast(_buffer(host, _move_type(t, "broadcast")), root=root)
        return self._work("broadcast", seq, request, lambda: _copy_back(t, host))

    def _alltoall(self, t: torch.Tensor, seq: int, out: Optional[torch.Tensor] = None) -> Work:
        host = self._host(t)
        result = _output(out, host, tuple(t.shape), t.dtype)
        dtype = _move_type(t, "alltoall")
        request = self.mpi_comm.Ialltoall(_buffer(host, dtype), _buffer(result, dtype))
        return self._work("alltoall", seq, request, lambda: _deliver(result, out, t.device), host)

    def _barrier(self, seq: int) -> Work:
        return self._work("barrier", seq, self.mpi_comm.Ibarrier(), lambda: None)

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> Work:
        host = self._host(t)
        request = self.mpi_comm.Isend(_buffer(host, _move_type(t, "send")), dest=dst, tag=tag)
        return self._work(f"send to {dst}", -1, request, lambda: t, host)

    def _recv(self, t: torch.Tensor, src: Optional[int], tag: int) -> Work:
        host = self._host(t)
        if self._probe_first:
            return self._recv_after_probe(t, host, src, tag)
        source = MPI.ANY_SOURCE if src is None else src
        request = self.mpi_comm.Irecv(_buffer(host, _move_type(t, "recv")), source=source, tag=tag)
        status = MPI.Status()

        def test() -> bool:
            try:
                return bool(request.Test(status))
            except MPI.Exception as exc:
                raise _recv_error(exc, src, tag, t) from None

        def finish() -> torch.Tensor:
            work.source = status.Get_source()
            if status.Get_count(MPI.BYTE) != t.numel() * t.element_size():
                raise _short_message(status.Get_count(MPI.BYTE), work.source, tag, t)
            return _copy_back(t, host)

        work = Work(self, f"recv from {_peer_name(src)}", -1, test, finish, keep=host)
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
                    into = _buffer(host, _move_type(t, "recv")) if got <= nbytes else [bytearray(got), MPI.BYTE]
                    matched.append(message.Irecv(into))
                return bool(matched[0].Test(status))
            except MPI.Exception as exc:
                raise _recv_error(exc, src, tag, t) from None

        def finish() -> torch.Tensor:
            work.source = status.Get_source()
            if status.Get_count(MPI.BYTE) != nbytes:
                raise _short_message(status.Get_count(MPI.BYTE), work.source, tag, t)
            return _copy_back(t, host)

        work = Work(self, f"recv from {_peer_name(src)}", -1, test, finish, keep=host)
        return work

    def _split(self, color: Optional[int], key: int, seq: int) -> Optional[Communicator]:
        # Agree on the split with a bounded collective first, so that a missing rank
        # is a timeout error rather than a hang inside MPI_Comm_split.
        self._barrier(seq).wait()
        child = self.mpi_comm.Split(MPI.UNDEFINED if color is None else color, key)
        if child == MPI.COMM_NULL:
            return None
        made = MpiCommunicator(child, timeout=self.timeout, debug=self.debug, tuning=self._tuning)
        made.check_every = self.check_every
        return made

    @contextlib.contextmanager
    def _on_exit_channel(self) -> Iterator[None]:
        """Run the exit barrier's collectives on `_exit_comm`, over plain MPI (not the shared-memory engine)."""
        main = self.mpi_comm
        self.mpi_comm = self._exit_comm
        self._open_shm_gates(closed=True)
        try:
            yield
        finally:
            self.mpi_comm = main
            self._open_shm_gates()

    def _close(self) -> None:
        # Freeing the window waits for every rank: meet at a bounded barrier first,
        # and leave the resources to the process exit if someone does not come.
        with self._on_exit_channel():
            self._exit_barrier()
        if self._broken:
            return  # collectives may be pending; freeing would wait on them
        self._exit_comm.Free()
        self._check_comm.Free()
        self._pair = None  # its communicator goes with it, and with the last of its collectives in flight
        if self._node is not None:
            self._node.close()
            self._node.node.Free()
        if self._cross is not None:
            self._cross.Free()
        self._progress.close()
        if self.mpi_comm != MPI.COMM_WORLD:
            self.mpi_comm.Free()


_Tensor = torch.Tensor
_COMPILED_PATHS = ("allreduce", "allgather", "reduce_scatter", "broadcast")
_DEFINED = {name: vars(MpiCommunicator)[name] for name in _COMPILED_PATHS}
"""The Python fast paths as defined here, to tell them from a later wrapper (see _compile_blocking_paths)."""
_IN_PLACE = MPI.IN_PLACE
_BYTE = MPI.BYTE
_SEQUENCES = (list, tuple)
_WAIT = 2e-3
"""Seconds a blocking fast-path call tests its operation (at full speed, then yielding the core) before it falls
back to the bounded wait of a `Work`."""
_NO_WAIT = -1.0
_INT_COUNT = 2**31
"""Bytes from which a message goes to the general path: the compiled calls pass an int count (mpi4py switches
to MPI-4's large-count calls)."""
_DEVICE_PAIR_BELOW = 4 << 20
"""A CUDA tensor on CUDA-aware MPI goes as a reduce_scatter's messages (through host memory: the reduction runs on
the CPU) only below these bytes each way; from there MPI's collective reads device memory. The cap the CPU's
shared-memory gate set before messages took every size on the CPU (2026-12-05); not yet measured on a GPU."""
_VOTE = (torch.int64, "max")
_NOT_FAST = (None, None, 0)
_ALLREDUCE, _ALLGATHER, _REDUCE_SCATTER, _BROADCAST = (
    OP_CODES[name] for name in ("allreduce", "allgather", "reduce_scatter", "broadcast")
)


class _Declined(Exception):
    """Inside `start_briefly`: the fast path did not take the call (see `_decline_brief`)."""


class FastTables:
    """What the fast paths look up per call: MPI datatype, MPI op (in the form `calls` takes) and agreement code
    per (dtype, op)."""

    def __init__(self, calls: mpi_calls.Calls) -> None:
        handle = self._handle = calls.handle
        self.allreduce: dict[tuple[torch.dtype, str], tuple[Any, Any, int]] = {}
        self.reduce_scatter: dict[tuple[torch.dtype, str], tuple[Any, Any, int]] = {}
        self.move: dict[torch.dtype, tuple[Any, int]] = {}
        self.broadcast: dict[tuple[torch.dtype, Any], tuple[Any, int]] = {}
        for dtype, mpi_type in _NATIVE.items():
            name = agreement.dtype_name(dtype)
            for op, mpi_op in _OPS.items():
                if (op == "avg" and not (dtype.is_floating_point or dtype.is_complex)) or (
                    dtype.is_complex and op in ("max", "min")
                ):
                    continue  # the general path raises the error that says why
                detail = f"op={op}"
                types = (handle(mpi_type), handle(mpi_op))
                self.allreduce[dtype, op] = (*types, agreement.code("allreduce", name, detail))
                self.reduce_scatter[dtype, op] = (*types, agreement.code("reduce_scatter", name, detail))
        for dtype, mpi_type in _MOVE_TYPES.items():
            self.move[dtype] = (handle(mpi_type), agreement.code("allgather", agreement.dtype_name(dtype), ""))

    def add_broadcast(self, dtype: torch.dtype, root: int) -> Optional[tuple[Any, int]]:
        if dtype not in _MOVE_TYPES:
            return None
        code = agreement.code("broadcast", agreement.dtype_name(dtype), f"root={root}")
        spec = (self._handle(_MOVE_TYPES[dtype]), code)
        self.broadcast[dtype, root] = spec
        return spec


def _pair_mismatch(owner: Any, op: str, expected: int, received: int, peer: int) -> None:
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


def _peer_name(src: Optional[int]) -> str:
    return "any rank" if src is None else str(src)


def _recv_error(exc: Exception, src: Optional[int], tag: int, t: torch.Tensor) -> CommError:
    return CommError(
        f"recv from {_peer_name(src)} (tag {tag}) into {t.numel()} x {agreement.dtype_name(t.dtype)} "
        f"({t.numel() * t.element_size()} B) failed in MPI: {exc}. A message longer than the receiving tensor "
        "is truncated: the sender's tensor must have the receiver's shape and dtype."
    )


def _short_message(got: int, src: int, tag: int, t: torch.Tensor) -> CommError:
    nbytes = t.numel() * t.element_size()
    what = "the rest of the tensor would hold stale values" if got < nbytes else "nothing was written into it"
    return CommError(
        f"recv from {src} (tag {tag}): rank {src} sent {got} B, but this rank receives into {t.numel()} x "
        f"{agreement.dtype_name(t.dtype)} ({nbytes} B); {what}. The sender's tensor must have the receiver's "
        "shape and dtype."
    )


def _output(out: Optional[torch.Tensor], engine_side: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The buffer MPI writes into: the caller's `out` when MPI can use it directly, else a new one."""
    if out is not None and out.device == engine_side.device and out.dtype == dtype:
        return out
    return torch.empty(shape, dtype=dtype, device=engine_side.device)


def _deliver(
    result: torch.Tensor, out: Optional[torch.Tensor], device: torch.device, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """Hand the engine's result back on the caller's device and dtype (into `out` when given)."""
    if out is not None:
        return out if result is out else out.copy_(result)
    return result.to(device=device, dtype=dtype or result.dtype)


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
    k = env_number("HPDL_RANKS_PER_NODE", 0, int, "a positive int")
    if not k:
        return node
    virtual = node.Split(node.Get_rank() // k, node.Get_rank())
    node.Free()
    return virtual
