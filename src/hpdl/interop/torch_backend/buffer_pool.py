"""Communication buffers that FSDP2 gets back from the group instead of allocating them afresh at every step.

FSDP2 allocates each all-gather output and reduce-scatter input anew. A CPU
buffer above glibc's mmap threshold (32 MiB at most) is then a fresh mapping
whose pages fault in on first touch: 64 MiB filled took 16.7 ms fresh and
2.9 ms reused here, and the faults' cost varies with the VM. A program that
calls `set_allocate_memory_from_process_group_for_comm(True)` on its FSDP2
modules (torch's own switch, made for NCCL's allocator) asks the group for
these buffers (`allocate_tensor`); an hpdl group hands out one that an
earlier, freed buffer of the same size class left here.

A buffer returns when torch frees the last tensor that uses it (a finalizer
on the numpy array under it, which only queues it: the garbage collector
may run it on a thread inside the pool's lock); the next request sorts it
into its class. A pool holds memory that would otherwise go back to the
system (FSDP2's step on a 53.5M-parameter MLP: about 250 MiB at its peak
with the pool, 175 without, and 1.2-1.6x faster); three rules keep it down:
- a request with no waiting buffer of its class may take one of a larger
  class up to `LEND_AT_MOST` times its size (resident already);
- a request that must make a new buffer first lets go of the waiting
  buffers of smaller classes (they cannot serve it, and memory grows now);
- a class neither asked for nor given back within the last `IDLE_REQUESTS`
  requests loses its waiting buffers (sizes the program no longer uses).
At most `HPDL_TORCH_POOL_MB` (default 1024) waits; 0 turns the pool off.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict, deque
from typing import Optional

import numpy as np
import torch

from hpdl.comm.env import env_number

__all__ = ["BufferPool", "pool", "size_class"]

MIN_POOLED_BYTES = 1 << 20
"""Smaller buffers come from torch as usual: the allocator's heap serves them without new mappings."""
CLASSES_PER_DOUBLING = 8
"""Sizes are rounded up to one of this many steps per power of two (at most 12.5% more than asked)."""
LEND_AT_MOST = 2
"""A request with no waiting buffer of its class may take one of a larger class up to this many times its size."""
IDLE_REQUESTS = 16
"""A class not asked for within this many requests (of any class) loses its waiting buffers."""


def size_class(nbytes: int) -> int:
    """The bytes a buffer of `nbytes` is made with, so that nearby sizes reuse the same buffers."""
    step = max(1 << max((nbytes - 1).bit_length() - CLASSES_PER_DOUBLING.bit_length(), 0), 64)
    return -(-nbytes // step) * step


class BufferPool:
    """Freed communication buffers by size class, reused by the next request of that class."""

    def __init__(self, limit_bytes: Optional[int] = None, min_bytes: int = MIN_POOLED_BYTES):
        self._limit = limit_bytes
        """None: HPDL_TORCH_POOL_MB, read at first use (a wrong value is an error there, not at import)."""
        self.min_bytes = min_bytes
        """Requests below this size come from torch as usual."""
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        """Size class -> returned buffers."""
        self._returned: deque[tuple[torch.Tensor, int]] = deque()
        """Buffers torch freed, with what their lending added, not yet sorted into `_free`. A finalizer only
        appends here, without the lock: the garbage collector may run it on a thread that holds the lock."""
        self._requests = 0
        self._last_used: dict[int, int] = {}
        """Size class -> the request count when a buffer of it was last asked for or given back."""
        self._lock = threading.Lock()
        self._held = 0
        self._lent_beyond = 0
        self._closed = False
        """After `clear()`: returned buffers are let go (until the next request)."""
        self.made = 0
        self.reused = 0

    @property
    def limit_bytes(self) -> int:
        if self._limit is None:
            mib = env_number("HPDL_TORCH_POOL_MB", 1024.0, float, "a number of MiB", allow_zero=True)
            self._limit = int(mib * 2**20)
        return self._limit

    @property
    def enabled(self) -> bool:
        return self.limit_bytes > 0

    @property
    def held_bytes(self) -> int:
        """Bytes of returned buffers waiting here (resident: they were used)."""
        self._settle()
        return self._held

    @property
    def lent_beyond_bytes(self) -> int:
        """Bytes by which the buffers in use exceed their requests' own classes (a request lent a larger buffer
        keeps all of it: resident, as it was used before)."""
        self._settle()
        return self._lent_beyond

    def _settle(self) -> None:
        """Sort in what torch gave back, so that the counts are current (what goes is freed outside the lock)."""
        with self._lock:
            dropped = self._sort_returned()
        del dropped

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of `numel` elements of `dtype` (uninitialised, like `torch.empty`)."""
        nbytes = numel * dtype.itemsize
        if nbytes < self.min_bytes or not self.enabled:
            return torch.empty(numel, dtype=dtype)
        size = size_class(nbytes)
        with self._lock:
            self._closed = False
            dropped = self._sort_returned()
            self._requests += 1
            self._last_used[size] = self._requests
            backing = self._take(size)
            if backing is not None:
                self._held -= backing.numel()
                self.reused += 1
            else:
                self.made += 1
            dropped += self._let_go_of_idle(smaller_than=size if backing is None else 0)
            beyond = backing.numel() - size if backing is not None else 0
            self._lent_beyond += beyond
        del dropped  # (freed outside the lock)
        if backing is None:
            backing = torch.empty(size, dtype=torch.uint8)
        whole = backing.numpy()
        lent = np.ndarray((nbytes,), np.uint8, buffer=memoryview(whole))  # type: ignore[arg-type]
        returned = weakref.finalize(lent, self._returned.append, (backing, beyond))  # when torch drops the last
        returned.atexit = False  # tensor over `lent`
        return torch.from_numpy(lent).view(dtype)

    def _take(self, size: int) -> Optional[torch.Tensor]:
        """A waiting buffer of class `size`, else the smallest waiting one of a larger class up to LEND_AT_MOST
        times `size` (FSDP2's first layer asks for small buffers while the large ones of the layers after it
        wait; called under the lock)."""
        waiting = self._free.get(size)
        if waiting:
            return waiting.pop()
        larger = [other for other, buffers in self._free.items() if size < other <= LEND_AT_MOST * size and buffers]
        return self._free[min(larger)].pop() if larger else None

    def _sort_returned(self) -> list[torch.Tensor]:
        """Move the buffers torch gave back into their classes, within the limit; those over it, or given back
        after `clear()`, are returned to be freed outside the lock (called under the lock)."""
        dropped = []
        while self._returned:
            backing, beyond = self._returned.popleft()
            self._lent_beyond -= beyond
            size = backing.numel()
            if self._closed or self._held + size > self.limit_bytes:
                dropped.append(backing)
                continue
            self._free[size].append(backing)
            self._last_used[size] = self._requests
            self._held += size
        return dropped

    def _let_go_of_idle(self, smaller_than: int = 0) -> list[torch.Tensor]:
        """Take out the waiting buffers of every class below `smaller_than` and of every class that was neither
        asked for nor given back within the last IDLE_REQUESTS requests (called under the lock)."""
        idle = []
        for size, waiting in self._free.items():
            if waiting and (size < smaller_than or self._last_used[size] < self._requests - IDLE_REQUESTS):
                idle += waiting
                self._held -= size * len(waiting)
                waiting.clear()
        return idle

    def clear(self) -> None:
        """Let every waiting buffer go, and those in use as they come back, until the next request (the memory
        returns to the system; destroying an hpdl group does this)."""
        with self._lock:
            dropped = self._sort_returned()
            for waiting in self._free.values():
                dropped += waiting
            self._free = defaultdict(list)
            self._held = 0
            self._closed = True
        del dropped


pool = BufferPool()
"""One pool for the process: every hpdl group's buffers are ordinary memory, whichever group asked."""
