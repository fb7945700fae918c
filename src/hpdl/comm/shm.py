"""Shared-memory collectives inside a node, and hierarchical allreduce across nodes.

MPICH's own shared-memory `Allreduce` moves a 64 MB buffer between two ranks
at a fraction of memory bandwidth. Here the ranks of a node map each other's
buffers through an MPI-3 shared window (`MPI_Win_allocate_shared` on the
`MPI_COMM_TYPE_SHARED` communicator) and do the work with plain memory
operations:

    1. every rank copies its input into its own segment (no copy when the
       tensor already lives in a window: `Communicator.shared_buffer`);
    2. rank i reduces slice i across all segments, in place in its segment
       (reading the other ranks' memory directly);
    3. every rank copies the reduced slices into its output.

Between the phases the ranks meet at a flag barrier in shared memory: each
rank publishes a phase counter and waits, with the communicator's timeout,
until every rank of the node has reached it, so no rank overwrites a slice
before every rank has read it, and a missing rank is named in the error.
Across nodes (`HierarchicalAllreduce`), step 2 is followed by an MPI
allreduce of each slice among the ranks with the same local rank, so every
local rank drives its own slice over the network in parallel.
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
import time
import warnings
from array import array
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import numpy as np
import torch

from hpdl.comm import fusion, work
from hpdl.comm.env import env_flag, env_number
from hpdl.errors import CollectiveMismatchError, CommTimeoutError

if TYPE_CHECKING:
    from hpdl.comm.fusion import Bucket

__all__: list[str] = []

DEFAULT_SEGMENT_MB = 32.0
"""Staging memory per rank (HPDL_SHM_MB); larger tensors go through it in pieces."""

DEFAULT_PIECE_MB = 4.0
"""Largest piece per round of copy in, reduce, copy out (HPDL_SHM_PIECE_MB). Measured on 2 ranks of a 2-core
VM (1 MiB L2 per core, 32 MiB L3), tight loops of allreduce against mpi4py: pieces of 2-4 MB made the
copied-in path 1.6x MPICH at 4-24 MiB, where whole 32 MB pieces fell out of cache and lost (0.88x at 24 MiB);
zero-copy buffers gained too (3.0 -> 3.6x at 8 MiB)."""

_MB = 1024 * 1024
# Smallest message (bytes) that takes the shared-memory path, per operation:
# (when every rank's tensor is a shared buffer: zero copy in) and (for
# ordinary tensors, which must first be copied in). Chosen on 2 ranks of a
# 2-core VM with MPICH 5.0.2, 4 MB pieces, where `hpdl bench comm` (one call
# between barriers) and tight loops of calls (caches warm) both had the
# shared-memory path faster: allreduce 1.3x zero-copy at 1 MiB, 1.2-1.4x
# copied in from 4 MiB (at 1 MiB copied in, the loops said 1.1x and the
# benchmark 0.8x: left to MPICH); allgather 1.5x zero-copy from 16 MiB of
# output and 1.4x copied in from 32 MiB; reduce_scatter 1.5x zero-copy
# from 2 MiB of input, copied in only where MPICH's own slows down (4x at
# 64 MiB; 0.9-1.5x at 16-48 MiB). MPICH's broadcast is never slower.
# A later VM of the same kind (2026-12-02, same MPICH; tight loops alternating
# the shared-memory and MPI paths of one communicator) had allreduce slower
# through shared memory at 1 MiB zero-copy (1.1-1.8x MPI, 3 runs) and 4 MiB
# copied in (1.15-1.26x, 3 runs), faster from 2 MiB zero-copy in 2 runs of 3
# and from 8 MiB copied in in 3 runs of 4 (0.74-0.94x; 0.35-0.9x at 32-64
# MiB): allreduce moved to 2 MiB / 8 MiB. The crossover moves with the
# machine's memory bandwidth and its load: `hpdl tune` measures them on the
# machine and writes a file that hpdl.init reads (hpdl.comm.tuning).
# Allgather of ordinary tensors moved to never (2026-12-02): MPICH's own
# (one copy from each peer's memory) was as fast or faster at every size in
# `hpdl tune` twice (1.0-2.7x) and 1.3-5.4x faster in place (FSDP2's
# all-gathers; 16-128 MiB of output, one call between barriers, two runs).
# Reduce-scatter of ordinary tensors moved from 64 MiB to 8 MiB the same day,
# once a rank stopped staging its own block and pieces went round the staging
# segment: 0.77x MPI at 8 MiB and 0.62x at 32 MiB (one call between barriers),
# 0.72-0.86x from 1 MiB to 32 MiB in `hpdl tune`'s tight loops; 0.70-0.85x
# from 4 MiB in two later runs. Allreduce of ordinary tensors moved from 8 MiB
# to 32 MiB then: with pieces round the segment it was 1.06-1.23x MPI at 8-16
# MiB and 0.51-0.61x from 32 MiB (one call between barriers, four runs).
# Allreduce on shared buffers moved from 2 MiB to 1 MiB (2026-12-05) once the
# ranks each wrote their slice's sums into the others' buffers in the same pass
# (no copy out, two meetings a piece) and the compiled sum went block by block
# (`hpdl bench comm`, that route forced from 256 KiB, two runs: 1.34-1.46x
# mpi4py's time at 256 KiB, 0.98-1.03x at 512 KiB, 0.64-0.68x at 1 MiB,
# 0.54x at 2 MiB). Ordinary tensors stay at 32 MiB: copied in, the same
# route was 0.98-1.09x MPI at 4-16 MiB (two runs each way).
# HPDL_SHM_MIN_<OP>=bytes overrides both numbers of one operation.
NEVER = 1 << 62
DEFAULT_THRESHOLDS = {
    "allreduce": (1 * _MB, 32 * _MB),
    "reduce_scatter": (2 * _MB, 8 * _MB),
    "allgather": (16 * _MB, NEVER),
    "broadcast": (NEVER, NEVER),
}

FUSED_ALLREDUCE_MIN = 64 * 1024
"""Smallest fusion bucket (bytes, more than one tensor, a blocking `allreduce_coalesced`) reduced straight from
and into its tensors through shared memory (`NodeCollectives.allreduce_packed`) instead of packed, reduced by
MPI and unpacked (HPDL_SHM_MIN_ALLREDUCE_COALESCED overrides it). Measured on 2 ranks of a 2-core VM (MPICH
5.0.2, 4 KiB tensors, one call between barriers, medians of 400, two runs of each route), float32 summed in
place by the compiled loop / packed for MPI: 22-23 / 23-24 us at 32 KiB, 28-29 / 32-33 at 64 KiB, 40 / 50 at
128 KiB, 63-69 / 89-90 at 256 KiB, 218-244 / 347-358 at 800 KiB. (Before that loop, staging and reducing
everything through torch: 1.0-1.06x MPI's time at 200 KiB, 0.81-0.90x at 800 KiB.)"""

SHM_DIR = "/dev/shm"
"""Where MPI libraries keep shared windows (MPICH's files are there): a tmpfs of limited size, 64 MB in a
default Docker container. A process that touches a window's page beyond it dies of SIGBUS, with no message."""
MIN_SEGMENT = 1 << 20
"""The smallest staging segment per rank worth starting the engine for."""
_SPARE = 1 << 20
"""Room left in SHM_DIR beside what a window needs (page rounding, the MPI library's own segments)."""

_yield = getattr(os, "sched_yield", lambda: None)
_FLAG_SPINS = 4096
"""Looks at the flags the compiled wait takes before the bounded Python loop (deadline, timeout report) takes
over: a fraction of a millisecond, more than two ranks in step need."""

try:
    if not env_flag("HPDL_COMPILED", True):
        raise ImportError("HPDL_COMPILED=0")
    _flags: Any = importlib.import_module("hpdl.comm._flags")  # (a C module: no import edge to hpdl.comm)
except ImportError:  # not built (no C compiler at install): the flags are read through torch and MPI_Win_sync
    _flags = None
_OUTLIVING: list[Any] = []
"""Windows of shared buffers, kept until the process exits."""
_FLAG_STRIDE = 8  # int64 per rank: one 64-byte cache line each, so flags never share a line
_HALF = (torch.float16, torch.bfloat16)


def enabled() -> bool:
    """HPDL_SHM, read as every yes/no setting is (unset: on; empty, 0, false, no, off: off)."""
    return env_flag("HPDL_SHM", True)


def segment_bytes() -> int:
    megabytes = env_number("HPDL_SHM_MB", DEFAULT_SEGMENT_MB, float, "a number of megabytes")
    return int(megabytes * 1024 * 1024) // 64 * 64


def piece_bytes() -> int:
    megabytes = env_number("HPDL_SHM_PIECE_MB", DEFAULT_PIECE_MB, float, "a number of megabytes")
    return max(int(megabytes * 1024 * 1024) // 64 * 64, 64)


TWO_RANKS_SHARED = {"reduce_scatter": 4 * _MB}
"""On a communicator of two ranks that sends an op as messages at every size: where shared buffers on both ranks
still take the engine (bytes of input; other ops never). Measured 2026-12-05, 2 ranks of the 2-core VM, `hpdl
bench comm` (hpdl-mpi-shm, one call between barriers), once the engine summed both ranks' blocks where they lie
in one compiled pass (messages / engine, us, two runs each): 1 MiB of output per rank 252, 203 / 248, 240;
2 MiB 655, 532 / 459, 418; 4 MiB 1371 / 971; 64 MiB 22.9 / 15.2 ms (mpi4py 54.5 ms)."""


def thresholds(op: str, measured: Optional[tuple[int, int]] = None, messages: bool = False) -> tuple[int, int]:
    """(smallest size with shared buffers in use, smallest size for ordinary tensors), in bytes: HPDL_SHM_MIN_<OP>,
    else where `messages` (a two-rank communicator sends this op as messages at every size, and nothing was
    measured) never for ordinary tensors and `TWO_RANKS_SHARED` for shared buffers, else `measured` (`hpdl
    tune`'s), else the built-in numbers.

    Two ranks, MPICH 5.0.2, 2-core VM, `hpdl bench comm` (one call between barriers), hpdl / mpi4py with this
    engine (before 2026-12-05) and with messages, two runs each: reduce_scatter of ordinary tensors (copied in)
    0.86-0.94x / 0.54-0.60x at 4 MiB each way, 0.92x / 0.57x at 16 MiB, 0.55x / 0.35-0.36x at 64 MiB; on shared
    buffers in place 0.63-0.66x / 0.65-0.70x, 0.55x / 0.57-0.58x, 0.40x / 0.41x; allgather 0.94-1.18x in both."""
    both = env_number(f"HPDL_SHM_MIN_{op.upper()}", -1, int, "a number of bytes", allow_zero=True)
    if both >= 0:
        return (both, both)
    if messages:
        return (TWO_RANKS_SHARED.get(op, NEVER), NEVER)
    return DEFAULT_THRESHOLDS[op] if measured is None else measured


def available_bytes() -> Optional[int]:
    """Free bytes in SHM_DIR, or None where there is no such directory (nothing to check). HPDL_SHM_AVAILABLE_BYTES
    pretends a size (the tests' small-container case without a small container)."""
    pretend = env_number("HPDL_SHM_AVAILABLE_BYTES", -1, int, "a number of bytes", allow_zero=True)
    if pretend >= 0:
        return pretend
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def fitting_segment(wanted: int, available: int, ranks: int) -> int:
    """Staging bytes per rank: `wanted`, or each rank's share of half of `available` (whole cache lines) when that
    is less; 0 when that share is under MIN_SEGMENT (and under `wanted`): then the engine does not start."""
    share = max(available - _SPARE, 0) // 2 // max(ranks, 1) // 64 * 64
    return wanted if wanted <= share else share if share >= MIN_SEGMENT else 0


def short_of_shared_memory(available: int) -> str:
    """What to say when SHM_DIR is too small for what hpdl would put there."""
    return (
        f"{SHM_DIR} has {available / 2**20:.0f} MB free (64 MB is a container's default): docker run --shm-size=2g "
        "or --ipc=host gives more (Kubernetes: an emptyDir volume with medium: Memory mounted there)"
    )


def fused_threshold() -> int:
    """Bytes from which a blocking coalesced allreduce's buckets take `allreduce_packed`."""
    return env_number(
        "HPDL_SHM_MIN_ALLREDUCE_COALESCED", FUSED_ALLREDUCE_MIN, int, "a number of bytes", allow_zero=True
    )


def _views(win: Any, size: int) -> list[torch.Tensor]:
    """Every rank's part of a shared window, as uint8 tensors in this process's address space."""
    views = []
    for rank in range(size):
        memory, _ = win.Shared_query(rank)
        array = np.frombuffer(memory, dtype=np.uint8) if memory.nbytes else np.empty(0, np.uint8)
        views.append(torch.from_numpy(array))
    return views


def _combine(acc: torch.Tensor, other: torch.Tensor, op: str) -> None:
    """acc <- acc (op) other, elementwise and in place."""
    if acc.dtype == torch.bool:
        if op in ("sum", "max"):
            torch.logical_or(acc, other, out=acc)
        else:
            torch.logical_and(acc, other, out=acc)
    elif op in ("sum", "avg"):
        acc.add_(other)
    elif op == "max":
        torch.maximum(acc, other.to(acc.dtype), out=acc)
    elif op == "min":
        torch.minimum(acc, other.to(acc.dtype), out=acc)
    else:
        acc.mul_(other)


def _bounds(count: int, parts: int, index: int) -> tuple[int, int]:
    """Slice `index` of `count` elements cut into `parts` nearly equal slices."""
    base, extra = divmod(count, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (index < extra)


class SharedBuffer:
    """A tensor in a shared window, and the same region in every other rank of the node."""

    def __init__(self, win: Any, peers: list[torch.Tensor]):
        self.win = win
        self.peers = peers


class NodeCollectives:
    """Collectives among the ranks of one node through shared memory.

    `ranks` maps node-local ranks to the owning communicator's ranks (for
    error messages); `timeout` returns the communicator's current timeout.
    """

    def __init__(
        self,
        node: Any,
        ranks: list[int],
        timeout: Callable[[], float],
        describe: Callable[[], str],
        broken: Callable[[], None] = lambda: None,
        segment: Optional[int] = None,
        watch: Callable[[], None] = lambda: None,
        positions: Callable[[], str] = lambda: "",
    ):
        from mpi4py import MPI

        self.node = node
        self.local_rank = node.Get_rank()
        self.local_size = node.Get_size()
        self._others = [(self.local_rank + offset) % self.local_size for offset in range(1, self.local_size)]
        """The other ranks of the node in the order a reduction adds their values (`_reduce_my_slice`'s)."""
        self.ranks = ranks
        self._timeout = timeout
        self._describe = describe
        self._broken = broken
        self._watch = watch
        """Called about once a second while a meeting waits: raises when a peer can never come (the owning
        communicator's progress board shows it in another collective, or finished)."""
        self._positions = positions
        """Where every rank of the communicator is, in words, from its progress board ("" when unknown)."""
        self.segment = segment if segment is not None else segment_bytes()
        """Staging bytes per rank (HPDL_SHM_MB, or less where SHM_DIR is small: `fitting_segment`)."""
        self.short_of_memory = ""
        """Why the last `shared_buffer` came from ordinary memory, or ""."""
        self.piece = piece_bytes()
        self._flag_win = MPI.Win.Allocate_shared(8 * _FLAG_STRIDE, 8, comm=node)
        self._flag_win.Lock_all()
        # Per rank, one cache line: [phase, data's shared buffer (-1: staging), element offset, ...].
        self._descriptors = [view.view(torch.int64) for view in _views(self._flag_win, self.local_size)]
        self._words = [memoryview(d.numpy()).cast("B").cast("q") for d in self._descriptors]  # type: ignore[arg-type]
        """The same descriptors as memoryviews: a word read or written in a tenth of a tensor element's time."""
        self._flags = [descriptor[0:1] for descriptor in self._descriptors]
        self._flag_table = array("q", [flag.data_ptr() for flag in self._flags]).tobytes()
        """The flags' addresses, for the compiled wait (`_flags.c`)."""
        self._my_flag = self._flags[self.local_rank].data_ptr()
        self._descriptors[self.local_rank].zero_()
        self._stage_win = MPI.Win.Allocate_shared(self.segment, 64, comm=node)
        self._stage_win.Lock_all()
        self._stage = _views(self._stage_win, self.local_size)
        self._buffers: list[SharedBuffer] = []
        self._phase = 0
        node.Barrier()  # every flag is zero before anyone waits on it

    # ------------------------------------------------------------------ synchronisation
    def _sync(self, what: str) -> None:
        """Flag barrier: publish this rank's phase, wait (bounded) until every rank of the node reached it."""
        self._phase += 1
        mark = self._phase
        if _flags is not None:  # the same steps compiled: fence + flag, then a few thousand looks at the flags
            _flags.post(self._my_flag, mark)
            if _flags.wait(self._flag_table, mark, _FLAG_SPINS):
                return
        else:
            self._stage_win.Sync()  # data written before the flag is visible before the flag
            self._flags[self.local_rank].fill_(mark)
        self._flag_win.Sync()
        flags = self._flags
        deadline = next_watch = 0.0
        spins = 0
        while True:
            if all(int(flag) >= mark for flag in flags):
                break
            spins += 1
            if spins % 16 == 0:
                _yield()  # the rank this one waits for may need this core (more ranks than free cores)
            if spins % 256 == 0:
                now = time.perf_counter()
                if deadline == 0.0:
                    deadline = now + self._timeout()
                    next_watch = now + work.WATCH_SECONDS
                elif now > deadline:
                    self._raise_timeout(what, mark)
                elif now > next_watch:  # a straggler, or a peer in another collective: the board says which
                    next_watch = now + work.WATCH_SECONDS
                    try:
                        self._watch()
                    except BaseException:
                        self._broken()
                        raise
                if spins > 100_000:
                    time.sleep(0.0002)  # a straggler, not a transfer: stop burning the core
            self._flag_win.Sync()
        self._stage_win.Sync()  # what the others wrote before their flags is visible now

    def _raise_timeout(self, what: str, mark: int) -> None:
        self._broken()  # the other ranks may be anywhere: finalize must not wait on them
        missing = [self.ranks[i] for i, flag in enumerate(self._flags) if int(flag) < mark]
        names = ", ".join(str(r) for r in missing)
        try:
            where = self._positions()
        except Exception:  # the report must not hide the timeout itself
            where = ""
        raise CommTimeoutError(
            f"{what} (shared memory) did not complete within {self._timeout():.1f} s on rank "
            f"{self.ranks[self.local_rank]} ({self._describe()}): rank(s) {names} of this node did not reach "
            f"the same phase. {where + ' ' if where else ''}Every rank must call the same collectives in the same "
            "order; a rank that died or is stuck elsewhere is the usual cause.",
            op=what,
            missing=tuple(missing),
        )

    # ------------------------------------------------------------------ zero-copy buffers
    def shared_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor living in a new shared window (collective over the node: same arguments everywhere)."""
        from mpi4py import MPI

        self._sync("shared_buffer")  # bounded: allocating the window would wait for a missing rank forever
        itemsize = torch.empty(0, dtype=dtype).element_size()
        free = available_bytes()
        free = self.node.allreduce(free if free is not None else NEVER, op=MPI.MIN)  # (every rank is here: synced)
        if max(numel * itemsize, 1) * self.local_size + _SPARE > free:  # the same answer on every rank of the node
            self.short_of_memory = (
                f"a shared buffer of {numel * itemsize / 2**20:.1f} MB per rank for {self.local_size} ranks does not "
                f"fit: {short_of_shared_memory(free)}"
            )
            if self.local_rank == 0:
                warnings.warn(
                    f"hpdl: {self.short_of_memory}. It is ordinary memory instead: the collectives copy it in.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return torch.empty(numel, dtype=dtype)  # ordinary memory: the collectives copy it in, as any tensor
        self.short_of_memory = ""
        win = MPI.Win.Allocate_shared(max(numel * itemsize, 1), 64, comm=self.node)
        peers = [view[: numel * itemsize].view(dtype) for view in _views(win, self.local_size)]
        self._buffers.append(SharedBuffer(win, peers))
        return peers[self.local_rank]

    @property
    def has_buffers(self) -> bool:
        """Whether shared buffers exist (created collectively, so every rank agrees)."""
        return bool(self._buffers)

    def _locate(self, t: torch.Tensor) -> tuple[int, int]:
        """(buffer index, element offset) of `t` inside this rank's shared buffers, or (-1, 0)."""
        address, nbytes = t.data_ptr(), t.numel() * t.element_size()
        for index, buffer in enumerate(self._buffers):
            mine = buffer.peers[self.local_rank]
            start = mine.data_ptr()
            if (
                mine.dtype == t.dtype
                and start <= address
                and address + nbytes <= start + mine.numel() * t.element_size()
            ):
                return index, (address - start) // t.element_size()
        return -1, 0

    def peer_view(self, t: torch.Tensor, local: int) -> Optional[torch.Tensor]:
        """Node rank `local`'s counterpart of `t` (a part of one of this rank's shared buffers), or None."""
        index, offset = self._locate(t)
        if index < 0 or not t.is_contiguous():
            return None
        return self._buffers[index].peers[local][offset : offset + t.numel()].view(t.shape)

    def fence(self) -> None:
        """A memory barrier between this rank's stores and loads in shared memory before and after it: MPI_Win_sync
        on the staging window (the one in a passive-target epoch; the barrier is the processor's, for every window)."""
        self._stage_win.Sync()

    def _publish(self, t: torch.Tensor) -> bool:
        """Say where this rank's data lives for the coming operation; True when it is zero-copy."""
        index, offset = self._locate(t)
        mine = self._words[self.local_rank]
        mine[1], mine[2], mine[3] = index, offset, t.numel()
        return index >= 0

    def all_zero_copy(self, t: torch.Tensor) -> bool:
        """Whether every rank's `t` lives in a shared buffer (one flag barrier; the same answer everywhere)."""
        self._publish(t)
        self._sync("shared-memory path agreement")
        return all(words[1] >= 0 for words in self._words)

    def _sources(self, dtype: torch.dtype, start: int, count: int, at: int) -> list[torch.Tensor]:
        """Every rank's data for elements [start, start + count) of the operation (read after the first sync);
        staged data is at byte `at` of each rank's segment."""
        sources = []
        itemsize = torch.empty(0, dtype=dtype).element_size()
        for rank in range(self.local_size):
            index, offset = self._words[rank][1], self._words[rank][2]
            if index < 0:
                sources.append(self._stage[rank][at : at + count * itemsize].view(dtype))
            else:
                sources.append(self._sources_of(index, rank, dtype)[offset + start : offset + start + count])
        return sources

    def _chunk(self, dtype: torch.dtype) -> int:
        """Elements per piece (the same on every rank): what a rank's staging segment holds, and at most
        `piece` bytes, so that what a rank copies in is still in cache when it is reduced and copied out."""
        return max(min(self.segment, self.piece) // dtype.itemsize, 1)

    def _stage_in(self, zero_copy: bool, piece: torch.Tensor, at: int) -> None:
        if not zero_copy:
            self._stage[self.local_rank][at : at + piece.numel() * piece.element_size()].view(piece.dtype).copy_(piece)

    def _slots(self, size: int) -> Iterator[int]:
        """Byte offsets in the staging segments for an operation's successive pieces of at most `size` bytes: round
        the whole segment, not always its start. A rank that overwrites what a peer read a moment ago waits for
        the peer's cache to give the lines up: staging 64 MiB through the segment's first 4 MB took 25-50 ms in
        most runs on a 2-core VM, 5-13 ms round the segment. In runs where the start stayed fast it was the
        faster (allreduce 0.32-0.44x MPI's time at 32-128 MiB, against 0.51-0.61x), but it lost to MPI in the
        others (1.0-1.2x at 64-256 MiB), and round the segment never did (docs/comm.md)."""
        return itertools.cycle(range(0, max(self.segment // max(size, 1), 1) * size, size))

    # ------------------------------------------------------------------ collectives
    def allreduce(
        self,
        t: torch.Tensor,
        op: str,
        across: Optional[Callable[[torch.Tensor, str], None]] = None,
        divisor: int = 1,
    ) -> None:
        """Reduce `t` in place across the node (sum for avg: the caller divides, or says `divisor`: each slice is
        divided where it is reduced), then `across` nodes.

        Each piece: inputs visible (staged or in place) -> rank i reduces slice i
        into its own source -> every rank copies the reduced slices it lacks.
        """
        flat = t.view(-1)
        zero_copy = self._publish(flat)
        if across is None and op in ("sum", "avg") and fusion.summed_in_place(t.dtype) and t.is_cpu:
            self._allreduce_in_place(fusion.table_of([flat]), t.dtype, flat.numel(), divisor, zero_copy)
            return
        step = self._chunk(t.dtype)
        slots = self._slots(step * t.element_size())
        for start in range(0, max(flat.numel(), 1), step):
            piece, at = flat[start : start + step], next(slots)
            self._stage_in(zero_copy, piece, at)
            self._inputs_met("allreduce", start == 0)
            sources = self._sources(t.dtype, start, piece.numel(), at)
            self._reduce_my_slice(sources, piece.numel(), op, across, divisor)
            self._sync("allreduce: reduced slices")
            for rank in range(self.local_size):
                if rank != self.local_rank or not zero_copy:
                    a, b = _bounds(piece.numel(), self.local_size, rank)
                    piece[a:b].copy_(sources[rank][a:b])
            self._sync("allreduce: results read")

    def _reduce_my_slice(
        self,
        sources: list[torch.Tensor],
        count: int,
        op: str,
        across: Optional[Callable[[torch.Tensor, str], None]],
        divisor: int = 1,
    ) -> None:
        """Reduce this rank's slice of `count` elements over every rank's source, into its own source."""
        lo, hi = _bounds(count, self.local_size, self.local_rank)
        mine = sources[self.local_rank][lo:hi]
        acc = mine.float() if mine.dtype in _HALF else mine  # 16-bit floats accumulate in float32
        for offset in range(1, self.local_size):
            _combine(acc, sources[(self.local_rank + offset) % self.local_size][lo:hi], op)
        if across is not None:
            across(acc, op)
        if divisor != 1:
            acc.div_(divisor)
        if acc is not mine:
            mine.copy_(acc)

    def allreduce_packed(
        self,
        bucket: Bucket,
        op: str,
        across: Optional[Callable[[torch.Tensor, str], None]] = None,
        divisor: int = 1,
    ) -> None:
        """Allreduce a fusion bucket without its flat buffer: the tensors are staged straight into the segment
        and the reduced slices copied straight back into them, where packing the flat buffer, reducing it and
        unpacking it copy everything twice more (`divisor`: the reduced values are divided by it, an average)."""
        mine = self._words[self.local_rank]
        mine[1], mine[3] = -1, bucket.flat.numel()  # staged, not in a shared buffer
        if across is None and op in ("sum", "avg") and fusion.summed_in_place(bucket.flat.dtype):
            self._allreduce_in_place(bucket.table, bucket.flat.dtype, bucket.flat.numel(), divisor)  # type: ignore[arg-type]
            bucket.modified()
            return
        dtype, itemsize = bucket.flat.dtype, bucket.flat.element_size()
        step = self._chunk(dtype)
        slots = self._slots(step * itemsize)
        stage = self._stage[self.local_rank].data_ptr()
        count = bucket.flat.numel()
        for start in range(0, count, step):
            n, at = min(step, count - start), next(slots)
            bucket.pack_range(stage + at, start * itemsize, n * itemsize)
            self._inputs_met("allreduce_coalesced", start == 0)
            sources = self._sources(dtype, start, n, at)
            self._reduce_my_slice(sources, n, op, across, divisor)
            self._sync("allreduce_coalesced: reduced slices")
            for rank in range(self.local_size):
                a, b = _bounds(n, self.local_size, rank)
                bucket.unpack_range(sources[rank][a:b].data_ptr(), (start + a) * itemsize, (b - a) * itemsize)
            self._sync("allreduce_coalesced: results read")
        bucket.modified()

    def _allreduce_in_place(
        self, table: bytes, dtype: torch.dtype, count: int, divisor: int, zero_copy: bool = False
    ) -> None:
        """A float sum (or average) on one node of the tensors in `table` (the compiled copies' (address, bytes)
        pairs), with no flat buffer and no torch call per piece: a rank stages only the slices the others reduce,
        reduces its own slice where it lies (the compiled loop reads its values there, adds the others' staged
        ones in `_reduce_my_slice`'s order, writes the result back and into its segment) and copies the others'
        results from theirs. Staging everything, reducing in the segment and copying every slice back moves half
        as much again. A rank whose tensor is in a shared buffer (`zero_copy`) stages nothing and leaves its
        result where it lies; where every rank's tensor is in a shared buffer, each writes its slice's result
        into the others' buffers too (in the same pass), so nobody copies anything afterwards and a piece takes
        two meetings instead of three."""
        itemsize = dtype.itemsize
        step = self._chunk(dtype)
        slots = self._slots(step * itemsize)
        me, ranks = self.local_rank, range(self.local_size)
        stage = self._stage[me].data_ptr()
        order = self._others
        direct = False  # every rank's tensor in a shared buffer (known after the first meeting)
        for start in range(0, max(count, 1), step):  # (nothing: one empty piece, as the general route's)
            n, at = min(step, count - start), next(slots)
            bounds = [_bounds(n, self.local_size, rank) for rank in ranks]
            if not zero_copy:
                for rank in order:
                    a, b = bounds[rank]
                    fusion.pack_range(table, stage + at + a * itemsize, (start + a) * itemsize, (b - a) * itemsize)
            self._inputs_met("allreduce", start == 0)
            if start == 0:
                direct = all(words[1] >= 0 for words in self._words)
            bases = {rank: self._piece_address(rank, dtype, start, at) for rank in order}
            a, b = bounds[me]
            sources = tuple(bases[rank] + a * itemsize for rank in order)
            out = sources if direct else 0 if zero_copy else stage + at + a * itemsize
            fusion.reduce_range(table, dtype, (start + a) * itemsize, (b - a) * itemsize, out, sources, divisor)
            self._sync("allreduce: reduced slices")
            if direct:
                continue
            for rank in order:
                a, b = bounds[rank]
                fusion.unpack_range(table, bases[rank] + a * itemsize, (start + a) * itemsize, (b - a) * itemsize)
            self._sync("allreduce: results read")

    def _inputs_met(self, what: str, first: bool, phase: str = "inputs") -> None:
        """The meeting after every rank made its piece visible; at an operation's first piece, the size check."""
        self._sync(f"{what}: {phase}")
        if first:
            self._check_counts(what)

    def _check_counts(self, what: str) -> None:
        """After an operation's first meeting, before anything is written: on every rank alike, an error when the
        ranks' tensors hold different numbers of elements (a rank must not read or write past another's)."""
        counts = [words[3] for words in self._words]
        if len(set(counts)) > 1:
            sizes = ", ".join(f"rank {self.ranks[rank]}: {count}" for rank, count in enumerate(counts))
            self._sync(f"{what}: sizes read")  # nobody publishes its next call's before every rank read these
            raise CollectiveMismatchError(
                f"{what} (shared memory) on {self._describe()}: the ranks passed tensors of different sizes "
                f"({sizes} elements); no tensor was changed. Every rank must pass a tensor of the same size."
            )

    def _piece_address(self, rank: int, dtype: torch.dtype, start: int, at: int) -> int:
        """Where rank `rank`'s elements from `start` of the current operation are: staged at byte `at` of its
        segment, or in its shared buffer (read after the first sync, like `_sources`)."""
        index, offset = self._words[rank][1], self._words[rank][2]
        if index < 0:
            return self._stage[rank].data_ptr() + at
        return self._sources_of(index, rank, dtype).data_ptr() + (offset + start) * dtype.itemsize

    def reduce_scatter(self, t: torch.Tensor, op: str, out: torch.Tensor) -> None:
        """This rank's block of dim 0 of the node-wide reduction of `t`, into `out` (sum for avg)."""
        flat, result = t.view(-1), out.view(-1)
        block = result.numel()
        zero_copy = self._publish(flat)
        if op in ("sum", "avg") and fusion.summed_in_place(t.dtype) and t.is_cpu and out.is_cpu:
            self._reduce_scatter_in_place(flat, result, zero_copy)
            return
        step = max(self._chunk(t.dtype) // self.local_size, 1)
        me, blocks, dtype = self.local_rank, flat.view(self.local_size, block), t.dtype
        slots = self._slots(step * self.local_size * t.element_size())
        for start in range(0, max(block, 1), step):
            width, at = min(step, block - start), next(slots)
            if not zero_copy:  # stage the same columns of the others' blocks: [block 0 part | block 1 part | ...]
                staged = self._stage[me][at : at + width * self.local_size * t.element_size()]
                columns, wanted = staged.view(t.dtype).view(self.local_size, width), blocks[:, start : start + width]
                columns[:me].copy_(wanted[:me])
                columns[me + 1 :].copy_(wanted[me + 1 :])  # (this rank's own block is read where it is)
            self._inputs_met("reduce_scatter", start == 0)
            target = result[start : start + width]
            parts = [
                blocks[me, start : start + width]
                if rank == me
                else self._block_part(rank, dtype, block, width, start, at)
                for rank in range(self.local_size)
            ]
            acc = parts[self.local_rank].float() if t.dtype in _HALF else target
            if acc is target:
                target.copy_(parts[self.local_rank])
            for offset in range(1, self.local_size):
                _combine(acc, parts[(self.local_rank + offset) % self.local_size], op)
            if acc is not target:
                target.copy_(acc)
            self._sync("reduce_scatter: inputs read")

    def _reduce_scatter_in_place(self, flat: torch.Tensor, result: torch.Tensor, zero_copy: bool = False) -> None:
        """`reduce_scatter` of a float sum with the compiled loop: a rank stages the columns of the others' blocks
        (as the general route lays them out; nothing where its input is in a shared buffer, `zero_copy`, read
        where it lies) and writes into `result` the sum of its own copy of its block and the others', in one
        pass, in the general route's order (the same bits), with no torch call per piece."""
        dtype, itemsize, block = flat.dtype, flat.element_size(), result.numel()
        source, target = fusion.table_of([flat]), fusion.table_of([result])
        me, step = self.local_rank, max(self._chunk(dtype) // self.local_size, 1)
        slots = self._slots(step * self.local_size * itemsize)
        stage = self._stage[me].data_ptr()
        order = self._others
        for start in range(0, max(block, 1), step):
            width, at = min(step, block - start), next(slots)
            row = width * itemsize
            for rank in order if not zero_copy else ():  # row `rank` of the staged columns: [block 0 part | ...]
                fusion.pack_range(source, stage + at + rank * row, (rank * block + start) * itemsize, row)
            self._inputs_met("reduce_scatter", start == 0)
            own = flat.data_ptr() + (me * block + start) * itemsize  # (read where it is, in one pass with the rest)
            sources = (own, *(self._block_address(rank, dtype, block, width, start, at) for rank in order))
            fusion.reduce_range(target, dtype, start * itemsize, row, 0, sources, 1, assign=True)
            self._sync("reduce_scatter: inputs read")

    def _block_address(self, rank: int, dtype: torch.dtype, block: int, width: int, start: int, at: int) -> int:
        """The address of `_block_part`: rank `rank`'s copy of this rank's block from element `start`."""
        index, offset = self._words[rank][1], self._words[rank][2]
        if index < 0:
            return self._stage[rank].data_ptr() + at + self.local_rank * width * dtype.itemsize
        return (
            self._sources_of(index, rank, dtype).data_ptr()
            + (offset + self.local_rank * block + start) * dtype.itemsize
        )

    def _block_part(self, rank: int, dtype: torch.dtype, block: int, width: int, start: int, at: int) -> torch.Tensor:
        """Rank `rank`'s copy of this rank's block, elements [start, start + width) of it (staged at byte `at`)."""
        index, offset = self._words[rank][1], self._words[rank][2]
        if index < 0:
            staged = self._stage[rank][at : at + width * self.local_size * torch.empty(0, dtype=dtype).element_size()]
            return staged.view(dtype).view(self.local_size, width)[self.local_rank]
        begin = offset + self.local_rank * block + start
        return self._sources_of(index, rank, dtype)[begin : begin + width]

    def _sources_of(self, index: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        peer = self._buffers[index].peers[rank]
        if peer.dtype != dtype:
            raise ValueError(
                f"shared-memory collective: node rank {rank} passes a shared buffer of dtype {peer.dtype}, "
                f"this rank {dtype}; every rank must pass the same kind of tensor"
            )
        return peer

    def allgather(self, t: torch.Tensor, sizes: list[int], out: torch.Tensor) -> None:
        """Every rank's `t` (dim-0 sizes `sizes`) concatenated into `out`."""
        row = math.prod(t.shape[1:])
        counts = [n * row for n in sizes]
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        flat, result = t.reshape(-1), out.view(-1)
        # in place (this rank's input is its own block of `out`: FSDP2's all-gather): that block stays as it is
        mine_in_place = flat.data_ptr() == result.data_ptr() + starts[self.local_rank] * t.element_size()
        zero_copy = self._publish(flat)
        step = self._chunk(t.dtype)
        slots = self._slots(step * t.element_size())
        for start in range(0, max(max(counts), 1), step):
            at = next(slots)
            self._stage_in(zero_copy, flat[start : start + max(min(step, counts[self.local_rank] - start), 0)], at)
            self._sync("allgather: inputs")
            for rank in range(self.local_size):
                width = max(min(step, counts[rank] - start), 0)
                if width and (rank != self.local_rank or not mine_in_place):
                    source = self._sources(t.dtype, start, width, at)[rank]
                    result[starts[rank] + start : starts[rank] + start + width].copy_(source)
            self._sync("allgather: inputs read")

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        """Copy `root`'s (node-local rank) tensor into every rank's `t`."""
        flat = t.view(-1)
        zero_copy = self._publish(flat)
        step = self._chunk(t.dtype)
        slots = self._slots(step * t.element_size())
        for start in range(0, max(flat.numel(), 1), step):
            piece, at = flat[start : start + step], next(slots)
            if self.local_rank == root:
                self._stage_in(zero_copy, piece, at)
            self._inputs_met("broadcast", start == 0, "input")
            if self.local_rank != root:
                piece.copy_(self._sources(t.dtype, start, piece.numel(), at)[root])
            self._sync("broadcast: input read")

    def close(self) -> None:
        # Shared buffers stay mapped until the process exits (MPI_Finalize frees them):
        # tensors such as DataParallel's gradients may still point into them.
        _OUTLIVING.extend(buffer.win for buffer in self._buffers)
        for win in (self._stage_win, self._flag_win):
            win.Unlock_all()
            win.Free()
