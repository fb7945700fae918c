"""Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021) on CPU.

Two gradients a and b combine as (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b:
orthogonal gradients add, parallel ones average. N ranks (a power of two,
as Horovod requires) combine pairwise at distance 1, 2, 4, ... which is
the result of Horovod's vector-halving, distance-doubling reduction; dot
products are taken per tensor (per layer) in float64. Every rank gathers
the N tensors and runs the same arithmetic, so every rank gets the same
result.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from hpdl.comm.base import Communicator
from hpdl.horovod.engine import Finish

__all__ = ["combine", "reduce_all", "check", "launch"]


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two tensors of one shape."""
    a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
    dot = float(a64 @ b64)
    na, nb = float(a64 @ a64), float(b64 @ b64)
    ca = 1.0 - dot / (2 * na) if na > 0 else 1.0
    cb = 1.0 - dot / (2 * nb) if nb > 0 else 1.0
    return (ca * a64 + cb * b64).reshape(a.shape).to(a.dtype)


def reduce_all(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Adasum of every rank's tensor, pairwise at distance 1, 2, 4, ... (len(parts) a power of two)."""
    level = list(parts)
    while len(level) > 1:
        level = [combine(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check(tensors: Sequence[torch.Tensor], process_set: Any, size: int) -> None:
    if process_set.process_set_id != 0:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    if not is_power_of_two(size):
        raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported yet.")
    for t in tensors:
        if not t.dtype.is_floating_point:
            raise ValueError(f"Adasum reduces floating-point tensors, got {t.dtype}")


def launch(comm: Communicator, outputs: list[torch.Tensor], postscale_factor: float) -> Finish:
    """Gather every rank's tensors and combine them (the caller's `outputs` receive the result)."""
    n = comm.size
    works = [comm.allgather(out.reshape(1, -1), sizes=[1] * n, async_op=True) for out in outputs]

    def finish() -> Any:
        for out, work in zip(outputs, works):
            gathered = work.wait()
            out.copy_(reduce_all([gathered[r].view_as(out) for r in range(n)]))
            if postscale_factor != 1.0:
                out.mul_(postscale_factor)
        return list(outputs)

    return Finish(works, finish)
