"""The MPI calls under the mpi backend's fast paths: compiled where the build could, else through mpi4py.

A small collective's own time in MPICH is a fraction of a microsecond;
mpi4py's message handling (a list, a buffer object, a Request per call) is
about a microsecond on top, which is most of a 4-byte allreduce. The build
compiles `_mpi_fast.c` with the MPI compiler it finds (`mpicc` beside the
Python that installs hpdl, on PATH, or mpi4py's). It is used only when its
predefined handles equal those of the MPI that mpi4py runs on: a module built
for another MPI (or for another library's handle layout) would pass wrong
handles, so it is skipped, and `hpdl info` says why.

Both implementations have the same functions: start the nonblocking call on
raw addresses and handles, test it for up to `wait` seconds, and return None
when it completed (recv: the bytes received) or a `Request` for the caller's
bounded wait; a negative `wait` returns the `Request` untested.
HPDL_COMPILED=0 selects mpi4py (the tests run both).
"""

from __future__ import annotations

import os
import time
from types import ModuleType
from typing import Any, Optional

from mpi4py import MPI

import hpdl.settings as settings
from hpdl.comm.env import env_flag

__all__ = ["Calls", "compiled_calls", "counted_reduce_scatter", "finish_briefly", "memory_at", "select"]

_BUFFERS: dict[tuple[int, int], Any] = {}
_BUFFER_CACHE_SIZE = 1024
_EMPTY = bytearray(8)
_yield = getattr(os, "sched_yield", lambda: None)
_SPIN_SECONDS = 2e-6
"""Tests at full speed before a wait starts yielding the core between tests (the compiled module's, too: short,
for jobs with more ranks than free cores, where a rank that spins holds the core its partner needs)."""


MPICH_COUNTED_REDUCE_SCATTER = (512 * 1024, 2 * 1024 * 1024)
"""Input bytes [from, to) where MPICH's MPI_Ireduce_scatter_block is slow and its MPI_Ireduce_scatter is not."""


def counted_reduce_scatter(library: str) -> tuple[int, int]:
    """Input bytes [from, to) in which a reduce_scatter calls MPI_Ireduce_scatter (equal counts), not the
    `_block` call: the same operation, another algorithm.

    MPICH 5.0.2 on 2 ranks (2-core VM; tight loops, both calls alternating): the nonblocking
    MPI_Ireduce_scatter_block took 2.6-10x its blocking twin from 512 KiB up to 2 MiB of input (its
    recursive halving; the blocking call changes to pairwise exchange at 512 KiB), where
    MPI_Ireduce_scatter took 0.9-1.4x; every other size, and every other operation's nonblocking call, was
    within a few percent of the blocking one. Other libraries: no window unless set.
    HPDL_COUNTED_REDUCE_SCATTER=FROM:TO (bytes; 0: none) sets it, the same on every rank. The bytes are those MPI
    reduces (16-bit floats travel as float32: twice the input).
    """
    name = "HPDL_COUNTED_REDUCE_SCATTER"
    text = settings.text(name) or ""
    if not text:
        return MPICH_COUNTED_REDUCE_SCATTER if library.startswith("MPICH") else (0, 0)
    if text == "0":
        return (0, 0)
    try:
        low, high = (int(part) for part in text.split(":"))
    except ValueError:
        raise ValueError(f"{name}={text!r} must be FROM:TO (bytes of input, e.g. 524288:2097152) or 0") from None
    if not 0 <= low <= high:
        raise ValueError(f"{name}={text!r}: FROM:TO needs 0 <= FROM <= TO")
    return low, high


def memory_at(address: int, nbytes: int) -> Any:
    """An MPI buffer over `nbytes` at `address`, cached: gradient buckets and training buffers come back to the
    same addresses every step, and a buffer object costs more than the call on it."""
    if not nbytes:
        return _EMPTY[:0]
    key = (address, nbytes)
    memory = _BUFFERS.get(key)
    if memory is None:
        if len(_BUFFERS) >= _BUFFER_CACHE_SIZE:
            _BUFFERS.clear()
        memory = _BUFFERS[key] = MPI.buffer.fromaddress(address, nbytes)
    return memory


def finish_briefly(request: Any, wait: float, status: Any = None) -> Any:
    """None once `request` completed within `wait` seconds (tested at full speed, then yielding the core), else
    the request itself (negative `wait`: untested)."""
    if wait < 0:
        return request
    test = request.Test if status is None else (lambda: request.Test(status))
    if test():
        return None
    start = time.perf_counter()
    spent = 0.0
    while spent < wait:
        if spent > _SPIN_SECONDS:
            _yield()  # the peer may be waiting for this core
        if test():
            return None
        spent = time.perf_counter() - start
    return request


class Calls:
    """The calls through mpi4py: the handles are mpi4py's own objects."""

    compiled = False
    module: Any = None
    """The compiled module (its `Fast` runs whole blocking calls), or None."""

    @staticmethod
    def handle(obj: Any) -> Any:
        """What the calls take for an mpi4py communicator, datatype or op."""
        return obj

    @staticmethod
    def allreduce(comm: Any, address: int, nbytes: int, datatype: Any, op: Any, wait: float) -> Any:
        return finish_briefly(comm.Iallreduce(MPI.IN_PLACE, [memory_at(address, nbytes), datatype], op), wait)

    @staticmethod
    def allgather(comm: Any, send: int, out: int, nbytes: int, datatype: Any, wait: float) -> Any:
        mine = MPI.IN_PLACE if not send else [memory_at(send, nbytes), datatype]
        return finish_briefly(comm.Iallgather(mine, [memory_at(out, nbytes * comm.Get_size()), datatype]), wait)

    @staticmethod
    def reduce_scatter(comm: Any, address: int, out: int, nbytes: int, datatype: Any, op: Any, wait: float) -> Any:
        whole = [memory_at(address, nbytes * comm.Get_size()), datatype]
        return finish_briefly(comm.Ireduce_scatter_block(whole, [memory_at(out, nbytes), datatype], op), wait)

    @staticmethod
    def broadcast(comm: Any, address: int, nbytes: int, datatype: Any, root: int, wait: float) -> Any:
        return finish_briefly(comm.Ibcast([memory_at(address, nbytes), datatype], root), wait)

    @staticmethod
    def send(comm: Any, address: int, nbytes: int, datatype: Any, dst: int, tag: int, wait: float) -> Any:
        return finish_briefly(comm.Isend([memory_at(address, nbytes), datatype], dst, tag), wait)

    @staticmethod
    def recv(comm: Any, address: int, nbytes: int, datatype: Any, src: int, tag: int, wait: float) -> Any:
        status = MPI.Status()
        request = finish_briefly(comm.Irecv([memory_at(address, nbytes), datatype], src, tag), wait, status)
        return status.Get_count(MPI.BYTE) if request is None else request


class _Compiled(Calls):
    """The compiled calls: the handles are the MPI library's own (ints or addresses)."""

    compiled = True

    def __init__(self, module: ModuleType):
        self.module = module
        self.allreduce = module.allreduce  # type: ignore[method-assign]
        self.allgather = module.allgather  # type: ignore[method-assign]
        self.reduce_scatter = module.reduce_scatter  # type: ignore[method-assign]
        self.broadcast = module.broadcast  # type: ignore[method-assign]
        self.send = module.send  # type: ignore[method-assign]
        self.recv = module.recv  # type: ignore[method-assign]

    @staticmethod
    def handle(obj: Any) -> Any:
        return obj.handle


def _mapped_mpi_libraries() -> list[str]:
    """The MPI libraries this process has mapped (Linux), so that a mismatch says which two they are."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if "/libmpi" in line})
    except OSError:
        return []


_SELECTED: Optional[tuple[Calls, str]] = None


def compiled_calls() -> tuple[Optional[Calls], str]:
    """The compiled calls when they match the running MPI, else None; and a line that says which and why."""
    try:
        from hpdl.comm import _mpi_fast  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, (
            f"mpi4py (the compiled fast path is not built: {exc}; reinstall hpdl where `mpicc` of the MPI that "
            "mpi4py uses is on PATH)"
        )
    built = _mpi_fast.compiled_handles()
    running = {name: getattr(MPI, name).handle for name in built}
    if built != running:
        return None, (
            f"mpi4py (the compiled fast path was built for another MPI than the running {MPI.get_vendor()[0]}: "
            "reinstall hpdl with that MPI's `mpicc` on PATH)"
        )
    if not _mpi_fast.initialized():
        both = ", ".join(_mapped_mpi_libraries()) or "two copies of one"
        return None, (
            f"mpi4py (the compiled fast path was linked to another MPI library than mpi4py's; loaded: {both}; "
            "reinstall hpdl: `pip install --force-reinstall --no-deps --no-build-isolation hpdl` links mpi4py's)"
        )
    _mpi_fast.configure(MPI.Request.fromhandle, MPI.Exception)
    return _Compiled(_mpi_fast), "compiled (hpdl.comm._mpi_fast)"


def select() -> tuple[Calls, str]:
    """The calls this process uses (decided once, after MPI is initialized): compiled unless HPDL_COMPILED=0 or
    the module does not match; and the line that says which."""
    global _SELECTED
    if _SELECTED is None:
        calls, why = compiled_calls() if env_flag("HPDL_COMPILED", True) else (None, "mpi4py (HPDL_COMPILED=0)")
        _SELECTED = (calls or Calls(), why)
    return _SELECTED
