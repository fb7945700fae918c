"""What a spatial split costs before running it: halo bytes per step and activation bytes per rank.

    from hpdl.parallel.spatial.cost import spatial_estimate
    e = spatial_estimate(cnn, (1, 3, 2048, 2048), parts=4)
    e.halo_bytes_forward, e.activation_bytes_per_rank(whole_activation_bytes)

The shapes come from running the plain model once on the `meta` device (no
memory, no compute), the halo rows from the same `plan_windows` the layers
use, so the estimate and the run agree row for row. The planner's memory
formula is `hpdl.plan.memory.spatial_activation_bytes`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hpdl.parallel.spatial.convert import CONVS, POOLS
from hpdl.parallel.spatial.layers import conv_padding
from hpdl.parallel.spatial.partition import plan_windows

__all__ = ["SpatialEstimate", "spatial_estimate"]


@dataclass
class SpatialEstimate:
    parts: int
    dim: int
    halo_bytes_forward: list[int] = field(default_factory=list)
    """Bytes each rank sends in one forward (the backward sends as many gradient bytes back)."""
    halo_rows: dict[str, list[int]] = field(default_factory=dict)
    """Layer name -> halo rows each rank receives."""

    @property
    def halo_bytes_per_step(self) -> int:
        """The busiest rank's bytes sent in one training step (forward halos + backward gradients)."""
        return 2 * max(self.halo_bytes_forward or [0])

    def activation_bytes_per_rank(self, whole_activation_bytes: float) -> float:
        """1/parts of one process's activations plus the halos received (the planner's
        `hpdl.plan.memory.spatial_activation_bytes`, which sits above this package)."""
        return whole_activation_bytes / self.parts + self.halo_bytes_per_step / 2


def _window_args(module: nn.Module, d: int) -> tuple[int, int, int, int, int, str]:
    if isinstance(module, CONVS):
        lo, hi = conv_padding(module)[d]
        return module.kernel_size[d], module.stride[d], module.dilation[d], lo, hi, module.padding_mode  # type: ignore[return-value]

    def pick(v: Any) -> int:
        return int(v[d]) if isinstance(v, (tuple, list)) else int(v)

    stride = getattr(module, "stride", None) or module.kernel_size
    p = pick(module.padding)
    return pick(module.kernel_size), pick(stride), pick(getattr(module, "dilation", 1)), p, p, "zeros"


def spatial_estimate(model: nn.Module, input_shape: tuple[int, ...], parts: int, dim: int = 2) -> SpatialEstimate:
    """Halo traffic of `model` (a plain CNN) on inputs of `input_shape` split in `parts` slabs along `dim`."""
    meta = copy.deepcopy(model).to("meta")
    estimate = SpatialEstimate(parts, dim, [0] * parts)
    shapes: list[tuple[str, nn.Module, tuple[int, ...], int]] = []
    hooks = []
    for name, module in meta.named_modules():
        if isinstance(module, CONVS + POOLS):

            def record(mod: nn.Module, args: Any, name: str = name) -> None:
                x = args[0]
                shapes.append((name, mod, tuple(x.shape), x.element_size()))

            hooks.append(module.register_forward_pre_hook(record))
    try:
        with torch.no_grad():
            dtype = next((p.dtype for p in model.parameters()), torch.get_default_dtype())
            meta(torch.empty(input_shape, device="meta", dtype=dtype))
    finally:
        for h in hooks:
            h.remove()
    for name, module, shape, itemsize in shapes:
        kernel, stride, dilation, lo, hi, mode = _window_args(module, dim - 2)
        windows = plan_windows(shape[dim], parts, kernel=kernel, stride=stride, dilation=dilation,
                               pad_lo=lo, pad_hi=hi, mode=mode, layer=name)  # fmt: skip
        row_bytes = itemsize * math.prod(s for i, s in enumerate(shape) if i != dim)
        estimate.halo_rows[name] = [sum(len(rows) for rows in w.peers().values()) for w in windows]
        for w in windows:
            for q, rows in w.peers().items():
                estimate.halo_bytes_forward[q] += len(rows) * row_bytes
    return estimate
