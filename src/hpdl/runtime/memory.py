"""Keep freed memory for reuse in processes that allocate and free large blocks all the time (glibc's thresholds).

With glibc's defaults, blocks of 128 KiB and more come from fresh mmap()s at first, and later from the heap,
whose top goes back to the system whenever more than twice the last such block lies free at its end: every
few messages, or every few forward passes, fresh pages again. On the VMs this project runs on a fresh page
costs 0.3-8 ms per MiB (page faults the hypervisor serves). The mpi:// transport's inline copies streamed
1 MiB messages at 1.8 GB/s with 97,000 page faults on the sender against 3.5 GB/s and 24,000 with the heap
kept (TCP: 4.4 GB/s, 14,000; docs/dask.md), and a small CNN's forward pass, timed by the planner's profile,
alternated between 24 and 39 ms from one measurement to the next (24-25 ms kept; docs/plan.md). So the
transport's hub and the planner's processes fix the mmap threshold at 32 MiB and the trim threshold at
HPDL_MALLOC_KEEP (256 MiB): up to that much freed memory stays in the process for the next blocks. 0 leaves
malloc as it is; on other C libraries this does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import platform

import hpdl.settings as settings

__all__ = ["keep_freed_memory"]

logger = logging.getLogger(__name__)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20
"""glibc's own ceiling for its adaptive mmap threshold: larger blocks still get mmap()s of their own."""
_done = False


def keep_freed_memory() -> bool:
    """Set the thresholds once per process (HPDL_MALLOC_KEEP); whether they were set."""
    global _done
    keep = settings.number("HPDL_MALLOC_KEEP")
    if _done or not keep or platform.libc_ver()[0] != "glibc":
        return _done
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    keep = min(int(keep), 2**31 - 1)
    _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, keep))
    if not _done:
        logger.debug("mallopt refused the thresholds; malloc left as it is")
    return _done
