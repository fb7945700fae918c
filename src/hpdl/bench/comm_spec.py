"""What `hpdl bench comm` measures and the targets it reports against: shared by the worker and the report."""

from __future__ import annotations

__all__: list[str] = []

KIB = 1 << 10
MIB = 1 << 20
DEFAULT_SIZES = tuple(4**k for k in range(1, 14))  # 4 B .. 64 MiB
QUICK_SIZES = (4, KIB, 64 * KIB, MIB)
OPS = ("allreduce", "allgather", "reduce_scatter", "broadcast", "sendrecv")
COLUMNS = ("hpdl-mpi", "hpdl-mpi-shm", "hpdl-torch", "mpi4py", "torch.distributed")
SHM_OPS = ("allreduce", "allgather", "reduce_scatter")
SEPARATE_TENSORS = (
    "the MPI columns and the gloo columns use different tensor objects: torch.distributed marks the tensors it "
    "has reduced, and every later torch call on such an object pays for it (measured here: a 4 KB hpdl-mpi "
    "allreduce took 87 us on a tensor gloo had used, 25 us on a fresh view of the same memory)"
)
"""Operations with an hpdl-mpi-shm column: the same call on tensors from comm.shared_buffer (zero copy in)."""
GLOO_PREFIXES = ("hpdl-torch", "torch.distributed")
FUSION_TENSORS = 200
FUSION_BYTES = 4 * KIB
DEBUG_SIZES = (4, 64 * KIB, 4 * MIB)
COPY_FROM = 64 * KIB
ITEMSIZE = 4  # float32

# Targets printed as PASS/MISS at the end; a MISS never fails the run (benchmarks are not tests).
TARGET_VS_MPI4PY = 1.10
TARGET_VS_MPI4PY_FROM = 64 * KIB
TARGET_VS_GLOO = 0.7
TARGET_VS_GLOO_FROM = MIB
TARGET_SMALL_VS_MPI4PY = 1.30
TARGET_SMALL_UP_TO = 16 * KIB
TARGET_FUSION = 5.0
TARGET_FUSION_VS_FLAT = 1.5
TARGET_SHM_64MB = 3.0
TARGET_SHM_SPEEDUP = 1.5
TARGET_SHM_SPEEDUP_FROM = 4 * MIB
LOOP_CALLS = 100
"""Back-to-back calls per repetition in the loop section (OSU-style: one barrier, then the calls)."""
LOOP_UP_TO = 64 * KIB
"""Largest message of the loop section: above it a call's own cost no longer matters."""
ROOT_CALLS = 200
"""Back-to-back broadcasts per repetition in the root's section: the root's own time (issue 53's measure; an
eager send lets the root run ahead of the receivers, so the max over ranks hides what a call costs the root)."""
ROOT_UP_TO = MIB
"""Largest broadcast of the root's section (its targets: up to 16 KiB, and from 64 KiB)."""

TIMING = (
    "columns in a new random order every repetition (the same on every rank); "
    "per repetition and column: the column's own engine's barrier (MPI_Barrier for hpdl-mpi and mpi4py, "
    "torch.distributed.barrier for hpdl-torch and torch.distributed), then every rank times its own call with "
    "time.perf_counter(); a repetition's time is the max over ranks (send/recv: rank 0's round trip / 2; memory "
    "copy: rank 0 alone while the other ranks wait in MPI_Barrier); fusion: the two columns of 200 separate gloo "
    "calls alternate between themselves, every other column among the rest"
)
SIZE_MEANING = (
    "bytes = the message: allreduce/broadcast/send buffer; allgather: each rank's contribution (output = ranks x "
    "bytes); reduce_scatter: each rank's output block (input = ranks x bytes). GB/s = bytes / median time, 1 GB = 1e9 B"
)
