"""Time the node's shared-memory collectives against plain MPI, per operation and size (what `hpdl tune` writes).

Three paths of one communicator, alternating in shuffled order within each round (the same order on every rank),
so that a change of the host's load falls on all three alike: plain MPI, the shared-memory path on tensors that
live in a shared buffer (zero copy in) and on ordinary tensors (copied in). A round times enough back-to-back calls
to last a few milliseconds; each sample is the slowest rank's. The ratio to MPI is taken per round, then the
median over the rounds.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any, Callable, Sequence

import torch

from hpdl.comm import shm, tuning
from hpdl.errors import HpdlError

__all__ = ["OPS", "PATHS", "measure", "thresholds"]

OPS = ("allreduce", "reduce_scatter", "allgather", "broadcast")
PATHS = ("mpi", "zero-copy", "copied")
_FORCE = {"mpi": (shm.NEVER, shm.NEVER), "zero-copy": (0, shm.NEVER), "copied": (0, 0)}
"""The thresholds that send every size of an operation down one path."""
_ROUND_SECONDS = 0.003


def measure(comm: Any, sizes: Sequence[int], rounds: int = 7, ops: Sequence[str] = OPS) -> dict[str, list[dict]]:
    """Per operation, one row per size (bytes of float32: the input, or allgather's output): MPI's median time
    and the two shared-memory paths' median time ratios to it. Collective: the same arguments on every rank."""
    if not hasattr(comm, "_use_shm_thresholds"):
        raise HpdlError(f"hpdl tune measures the MPI backend's shared-memory path; this communicator is {comm!r}")
    largest = max(sizes) // 4 + comm.size
    shared = comm.shared_buffer(largest)
    if not comm.shm_status.startswith("on"):
        raise HpdlError(f"nothing to tune: the shared-memory path is {comm.shm_status}")
    shared.zero_()  # sums of zeros stay finite however many calls
    ordinary, out = torch.zeros(largest), torch.empty(largest)
    saved = dict(comm._shm_thresholds)
    order = random.Random(2026)  # seeded alike on every rank: every rank runs the paths in one order
    results: dict[str, list[dict]] = {}
    try:
        for op in ops:
            rows = []
            for nbytes in sorted(set(sizes)):
                numel = max(nbytes // 4 // comm.size, 1) * comm.size
                calls = {path: _call(comm, op, numel, shared if path == "zero-copy" else ordinary, out)
                         for path in PATHS}  # fmt: skip
                times = _alternate(comm, op, calls, rounds, order)
                row: dict[str, Any] = {"bytes": numel * 4, "mpi_us": statistics.median(times["mpi"]) * 1e6}
                for path in PATHS[1:]:
                    row[path] = statistics.median(a / b for a, b in zip(times[path], times["mpi"]))
                rows.append(row)
            results[op] = rows
    finally:
        for op, (zero_copy, ordinary_min) in saved.items():
            comm._use_shm_thresholds(op, zero_copy, ordinary_min)
    return results


def in_force(comm: Any) -> tuning.Thresholds:
    """The communicator's thresholds now, per operation."""
    return dict(comm._shm_thresholds)


def thresholds(results: dict[str, list[dict]]) -> tuning.Thresholds:
    """The thresholds the measurements support, for each operation measured."""
    chosen = {}
    for op, rows in results.items():
        copied = tuning.choose([(row["bytes"], row["copied"]) for row in rows])
        zero_copy = tuning.choose([(row["bytes"], row["zero-copy"]) for row in rows])
        chosen[op] = (min(zero_copy, copied), copied)  # where copying in wins, not copying wins too
    return chosen


def _call(comm: Any, op: str, numel: int, source: torch.Tensor, out: torch.Tensor) -> Callable[[], Any]:
    data = source[:numel]
    if op == "allreduce":
        return lambda: comm.allreduce(data)
    if op == "reduce_scatter":
        part = out[: numel // comm.size]
        return lambda: comm.reduce_scatter(data, out=part)
    if op == "allgather":
        mine, gathered = source[: numel // comm.size], out[:numel]
        return lambda: comm.allgather(mine, out=gathered)
    if op == "broadcast":
        return lambda: comm.broadcast(data, root=0)
    raise ValueError(f"hpdl tune: unknown operation {op!r}; choose from {', '.join(OPS)}")


def _alternate(
    comm: Any, op: str, calls: dict[str, Callable[[], Any]], rounds: int, order: random.Random
) -> dict[str, list[float]]:
    """Seconds per call of each path, one sample per round, the slowest rank's."""

    def timed(path: str, repeat: int) -> float:
        comm._use_shm_thresholds(op, *_FORCE[path])
        comm.barrier()
        start = time.perf_counter()
        for _ in range(repeat):
            calls[path]()
        return (time.perf_counter() - start) / repeat

    for path in PATHS:  # warm: the first call of a path sets up buffers
        timed(path, 2)
    once = torch.tensor([timed("mpi", 1)], dtype=torch.float64)
    comm.allreduce(once, "max")
    repeat = max(1, min(50, round(_ROUND_SECONDS / max(float(once), 1e-7))))
    samples = torch.zeros(len(PATHS), rounds, dtype=torch.float64)
    for r in range(rounds):
        for path in order.sample(PATHS, len(PATHS)):
            samples[PATHS.index(path), r] = timed(path, repeat)
    comm.allreduce(samples, "max")
    return {path: samples[i].tolist() for i, path in enumerate(PATHS)}
