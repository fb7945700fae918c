"""`clip_by_global_norm_`: the one global-norm clipping behind every strategy's `clip_grad_norm_`.

Each strategy knows which gradients it holds and over which communicators
the other parts of the model live; this function does the arithmetic and
the collectives, so that every layout clips to the same number.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch

from hpdl.comm.base import Communicator

__all__ = ["clip_by_global_norm_"]


@torch.no_grad()
def clip_by_global_norm_(
    grads: Iterable[Optional[torch.Tensor]],
    max_norm: float,
    *,
    counted: Optional[Iterable[Optional[torch.Tensor]]] = None,
    groups: Sequence[Optional[Communicator]] = (),
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Scale `grads` in place so that their global norm is at most `max_norm`; return the norm before clipping.

    The one implementation behind every `clip_grad_norm_` of hpdl (plain or
    data parallel, ZeRO shards, tp x pp meshes). `counted`: the gradients
    that enter the norm (default: all of `grads`; a tp rank > 0 leaves its
    replicated parameters out so they count once). `groups`: communicators
    over which this rank's partial sum of |g|^p (max |g| for the inf-norm)
    is combined: the ranks that hold *other* parts of the model. Collective
    over each group. Computes on the gradients' device in their dtype (at
    least float32) and scales as `torch.nn.utils.clip_grad_norm_` does,
    with its 1e-6 guard.
    """
    try:
        limit = float(max_norm)
    except (TypeError, ValueError):
        raise TypeError(f"clip_grad_norm_: max_norm={max_norm!r} must be a positive number") from None
    if not limit > 0:
        raise ValueError(f"clip_grad_norm_: max_norm={max_norm!r} must be a positive number")
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type={norm_type!r} must be positive (2.0, 1.0 or inf)")
    scaled = [g for g in grads if g is not None]
    terms = scaled if counted is None else [g for g in counted if g is not None]
    device = scaled[0].device if scaled else torch.device("cpu")
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in scaled) else torch.float32
    infinite = math.isinf(norm_type)
    parts = [g.detach() for g in terms if g.numel()]
    if not parts:
        local = torch.zeros((), dtype=dtype, device=device)
    elif infinite:
        local = torch.stack([g.abs().max().to(device, dtype) for g in parts]).max()
    else:
        powers = [torch.linalg.vector_norm(g, norm_type, dtype=dtype).to(device) ** norm_type for g in parts]
        local = torch.stack(powers).sum()
    reduce = [c for c in groups if c is not None and c.size > 1]
    if reduce:  # one number per rank: float64 on the host, whatever the device
        wire = local.reshape(1).to("cpu", torch.float64)
        for comm in reduce:
            comm.allreduce(wire, "max" if infinite else "sum")
        local = wire.reshape(()).to(device, dtype)
    total = local if infinite else local ** (1.0 / norm_type)
    coefficient = torch.clamp(limit / (total + 1e-6), max=1.0)
    for g in scaled:
        g.detach().mul_(coefficient.to(g.device, g.dtype))
    return total
