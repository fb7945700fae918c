"""Tensor fusion: many small tensors packed into few flat buffers, one engine call per buffer.

Every collective pays a fixed latency (alpha in the alpha-beta model); 200
gradients of 4 KB sent one by one pay it 200 times. Packing them into
buffers of up to `bucket_mb` megabytes pays it once per buffer (Horovod's
tensor fusion, DDP's buckets).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

__all__: list[str] = []

DEFAULT_BUCKET_MB = 64.0


def bucket_bytes(bucket_mb: Optional[float]) -> int:
    if bucket_mb is None:
        text = os.environ.get("HPDL_FUSION_MB", str(DEFAULT_BUCKET_MB))
        try:
            bucket_mb = float(text)
        except ValueError:
            raise ValueError(f"HPDL_FUSION_MB={text!r} must be a number of megabytes") from None
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb={bucket_mb} must be positive (megabytes per fused buffer)")
    return int(bucket_mb * 1024 * 1024)


@dataclass
class Bucket:
    """Tensors of one dtype and device that travel together in `flat`."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    flat: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    def unpack(self) -> None:
        if len(self.tensors) == 1 and self.tensors[0].data_ptr() == self.flat.data_ptr():
            return  # reduced in place, nothing to copy back
        offset = 0
        for t in self.tensors:
            n = t.numel()
            t.copy_(self.flat[offset : offset + n].view_as(t))
            offset += n


def pack(tensors: Sequence[torch.Tensor], limit_bytes: int) -> list[Bucket]:
    """Group tensors by (dtype, device) in order and copy each group into flat buffers of at most `limit_bytes`.

    A tensor larger than the limit gets a buffer of its own, which is the
    tensor itself (viewed flat, no copy).
    """
    groups: dict[tuple, list[list[torch.Tensor]]] = {}
    sizes: dict[tuple, int] = {}
    for t in tensors:
        key = (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        if key not in groups or sizes[key] + nbytes > limit_bytes:
            groups.setdefault(key, []).append([])
            sizes[key] = 0
        groups[key][-1].append(t)
        sizes[key] += nbytes
    buckets = []
    for runs in groups.values():
        for run in runs:
            if not run:
                continue
            flat = torch.cat([t.reshape(-1) for t in run]) if len(run) > 1 else run[0].view(-1)
            buckets.append(Bucket(run, flat))
    return buckets
