"""Layers that compute this rank's slab of a convolution, pooling or batch norm over the whole image.

Each keeps the plain layer's parameters and buffers under the same names
(state dicts and checkpoints see the plain model), and is built from the
plain layer by `from_module`. Along the split dimension a layer pads
nothing itself: its halo rows (neighbours' rows and padding rows) come
from `halo_window_forward`; along the other dimensions it pads as the
plain layer does.

With several split dimensions (`axes`: a grid of ranks, see grid.py) a
window layer first extends its block by the halos of every axis but the
first, one axis after the other, then runs the first axis's exchange,
overlapped with the interior, on the extended block: the rows that
neighbours send along the first axis carry the other axes' halos, corners
included. `comm` is then the whole grid (batch-norm statistics, global
pools), each axis's exchange runs on that axis's group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hpdl.comm.base import Communicator
from hpdl.parallel.spatial.extent import SpatialContext, global_rows
from hpdl.parallel.spatial.halo import FORWARD_TAG, TAG_STRIDE, HaloStats, halo_window_forward
from hpdl.parallel.spatial.partition import Window, plan_windows
from hpdl.parallel.spatial.slabs import gather, sum_over_slabs

__all__ = ["SpatialLayer", "SpatialConv", "SpatialPool", "SpatialBatchNorm", "SpatialGlobalPool", "SpatialFlatten"]

CALLS_PER_TAG = 16


@dataclass(frozen=True)
class Placement:
    """Where a spatial layer runs: its group, split dimension, name and number in the model, the model's
    shared context, and for a grid split (dim, group) per axis with `comm` the whole grid."""

    comm: Communicator
    dim: int
    name: str
    layer_id: int
    context: Optional[SpatialContext] = None
    axes: Optional[Sequence[tuple[int, Communicator]]] = None


class SpatialLayer(nn.Module):
    """Shared by the spatial layers: the group, the split dimension, and the per-layer halo bookkeeping."""

    spatial_params = True
    """Whether this layer's parameter gradients are partial (one slab's share) and must be summed."""

    def __init__(self, place: Placement):
        super().__init__()
        comm, dim = place.comm, place.dim
        self.comm, self.split_dim, self.layer_name, self.layer_id = comm, dim, place.name, place.layer_id
        self.axes: list[tuple[int, Communicator]] = list(place.axes) if place.axes else [(dim, comm)]
        """(split dimension, its group) per grid axis; one axis: (dim, comm)."""
        self.split_dims = [d for d, _ in self.axes]
        self.context = place.context
        self.stats = HaloStats()
        self.overlap = True
        self._windows: dict[tuple[int, int, int], list[Window]] = {}

    def rows(self, x: torch.Tensor) -> tuple[int, int]:
        dim, comm = self.axes[0]
        return global_rows(x, dim, comm, self.context, self.layer_id, self.layer_name)

    def extents(self, x: torch.Tensor) -> tuple[list[int], int]:
        """(global rows along every split dimension, call number)."""
        first, call = self.rows(x)
        rest = [
            global_rows(x, dim, comm, self.context, -(self.layer_id * 16 + axis), self.layer_name)[0]
            for axis, (dim, comm) in enumerate(self.axes[1:], 1)
        ]  # each axis counts its calls apart (the ids below 0 are free)
        return [first, *rest], call

    def split_text(self) -> str:
        if len(self.axes) == 1:
            return f"split dim {self.split_dim} over {self.comm.size}"
        return "split dims " + " x ".join(f"{d}({c.size})" for d, c in self.axes)

    def gather_axes(self, x: torch.Tensor) -> torch.Tensor:
        """The whole tensor on every rank: the blocks put together along one split dimension after another."""
        for dim, comm in self.axes:
            x = gather(x, comm, dim)
        return x

    def tag(self, call: int) -> int:
        return FORWARD_TAG + TAG_STRIDE * (self.layer_id * CALLS_PER_TAG + call % CALLS_PER_TAG)


def _pairs(value: Any, n: int) -> list[int]:
    return list(value) if isinstance(value, (tuple, list)) else [int(value)] * n


class _WindowLayer(SpatialLayer):
    """A sliding window along the split dimension (convolution or pooling)."""

    kernel: list[int]
    stride: list[int]
    dilation: list[int]
    pad: list[tuple[int, int]]
    mode: str
    fill: float

    def windows(self, n_in: int, parts: Optional[int] = None, axis: int = 0) -> list[Window]:
        """Every rank's window for an input of `n_in` rows along grid axis `axis` (over `parts` ranks: default,
        that axis's group)."""
        dim, comm = self.axes[axis]
        parts = comm.size if parts is None else parts
        found = self._windows.get((axis, n_in, parts))
        if found is None:
            d = dim - 2
            found = plan_windows(
                n_in,
                parts,
                kernel=self.kernel[d],
                stride=self.stride[d],
                dilation=self.dilation[d],
                pad_lo=self.pad[d][0],
                pad_hi=self.pad[d][1],
                mode=self.mode,
                layer=self.layer_name,
            )
            self._windows[(axis, n_in, parts)] = found
        return found

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extents, call = self.extents(x)
        tag = self.tag(call)
        for axis in reversed(range(len(self.axes))):
            dim, comm = self.axes[axis]
            d = dim - 2
            x = halo_window_forward(
                x,
                comm,
                self.windows(extents[axis], axis=axis),
                dim=dim,
                kernel_span=self.dilation[d] * (self.kernel[d] - 1) + 1,
                stride=self.stride[d],
                op=self.local_op if axis == 0 else _rows_read,  # the later axes only extend the block
                tag=tag,
                stats=self.stats,
                fill=self.fill,
                overlap=self.overlap and axis == 0,
            )
        return x

    def local_op(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def other_padding(self) -> list[int]:
        """F.pad's list (last dimension first) padding every dimension but the split ones."""
        pads: list[int] = []
        for d in reversed(range(len(self.pad))):
            lo, hi = (0, 0) if d + 2 in self.split_dims else self.pad[d]
            pads += [lo, hi]
        return pads

    def symmetric_other_padding(self) -> Optional[list[int]]:
        """Per-dimension padding with the split ones 0, when every other dimension pads the same on both sides."""
        if any(lo != hi for d, (lo, hi) in enumerate(self.pad) if d + 2 not in self.split_dims):
            return None
        return [0 if d + 2 in self.split_dims else lo for d, (lo, _) in enumerate(self.pad)]


def _rows_read(x: torch.Tensor) -> torch.Tensor:
    """The op of an axis that only extends the block: the rows the window reads, halos and padding included."""
    return x


CONV_FUNCTIONS: dict[int, Callable[..., torch.Tensor]] = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def conv_padding(conv: nn.modules.conv._ConvNd) -> list[tuple[int, int]]:
    """(before, after) padding of each spatial dimension, 'same' and 'valid' included."""
    n = len(conv.kernel_size)
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return [(0, 0)] * n
        pads = []
        for k, d in zip(conv.kernel_size, conv.dilation):
            total = d * (k - 1)
            pads.append((total // 2, total - total // 2))
        return pads
    return [(p, p) for p in conv.padding]


class SpatialConv(_WindowLayer):
    """Conv1d/2d/3d over the whole image, computed on this rank's slab plus halos."""

    def __init__(self, conv: nn.modules.conv._ConvNd, place: Placement):
        super().__init__(place)
        name = place.name
        n = len(conv.kernel_size)
        for split in self.split_dims:
            if not 2 <= split < 2 + n:
                raise ValueError(
                    f"{name} ({type(conv).__name__}): split dim {split} is not one of its spatial dims 2..{n + 1}"
                )
        self.nd = n
        self.weight = conv.weight
        self.bias = conv.bias
        self.kernel, self.stride, self.dilation = list(conv.kernel_size), list(conv.stride), list(conv.dilation)
        self.groups = conv.groups
        self.pad = conv_padding(conv)
        self.mode = conv.padding_mode
        self.fill = 0.0
        self.plain = type(conv).__name__

    def local_op(self, x: torch.Tensor) -> torch.Tensor:
        conv = CONV_FUNCTIONS[self.nd]
        if self.mode == "zeros":
            symmetric = self.symmetric_other_padding()
            if symmetric is not None:
                return conv(x, self.weight, self.bias, self.stride, symmetric, self.dilation, self.groups)
            x = F.pad(x, self.other_padding())
        else:
            x = F.pad(x, self.other_padding(), mode=self.mode)
        return conv(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return (
            f"{self.plain}, weight={tuple(self.weight.shape)}, kernel={self.kernel}, stride={self.stride}, "
            f"pad={self.pad}, dilation={self.dilation}, groups={self.groups}, mode={self.mode}, "
            f"{self.split_text()}"
        )


class SpatialPool(_WindowLayer):
    """MaxPool/AvgPool 1d/2d/3d over the whole image (floor mode)."""

    def __init__(self, pool: nn.Module, place: Placement):
        super().__init__(place)
        name = place.name
        kind = type(pool).__name__
        self.nd = int(kind[-2])
        for split in self.split_dims:
            if not 2 <= split < 2 + self.nd:
                raise ValueError(f"{name} ({kind}): split dim {split} is not one of its spatial dims 2..{self.nd + 1}")
        if getattr(pool, "ceil_mode", False):
            raise ValueError(
                f"{name} ({kind}): ceil_mode=True is not supported by spatial parallelism; use ceil_mode=False"
            )
        if getattr(pool, "return_indices", False):
            raise ValueError(f"{name} ({kind}): return_indices=True is not supported by spatial parallelism")
        self.is_max = kind.startswith("Max")
        n = self.nd
        self.kernel = _pairs(pool.kernel_size, n)
        self.stride = _pairs(pool.stride if pool.stride else pool.kernel_size, n)  # type: ignore[arg-type]
        self.dilation = _pairs(getattr(pool, "dilation", 1), n)
        self.pad = [(p, p) for p in _pairs(pool.padding, n)]
        self.count_include_pad = getattr(pool, "count_include_pad", True)
        self.divisor_override = getattr(pool, "divisor_override", None)
        if not self.is_max and not self.count_include_pad and any(self.pad[d - 2][0] > 0 for d in self.split_dims):
            raise ValueError(
                f"{name} ({kind}): count_include_pad=False with padding along the split dimension is not supported; "
                "use count_include_pad=True or no padding along that dimension"
            )
        self.mode = "zeros"
        self.fill = float("-inf") if self.is_max else 0.0
        self.plain = kind

    def local_op(self, x: torch.Tensor) -> torch.Tensor:
        padding = self.symmetric_other_padding()
        assert padding is not None  # pooling pads symmetrically
        n = self.nd
        if self.is_max:
            max_pool: Any = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[n]
            return max_pool(x, self.kernel, self.stride, padding, self.dilation)
        if n == 1:
            return F.avg_pool1d(x, self.kernel, self.stride, padding, False, self.count_include_pad)
        avg_pool: Any = {2: F.avg_pool2d, 3: F.avg_pool3d}[n]
        return avg_pool(x, self.kernel, self.stride, padding, False, self.count_include_pad, self.divisor_override)

    def extra_repr(self) -> str:
        where = self.split_text()
        return f"{self.plain}, kernel={self.kernel}, stride={self.stride}, pad={self.pad}, {where}"


class _BatchNormFunction(torch.autograd.Function):
    """Batch norm with statistics over every rank's slab (one small allgather forward, one allreduce backward).

    Written for few passes over the slab (batch norm on a high-resolution slab is memory-bound; on CPU
    `var_mean` and broadcasting `addcmul` are ten times slower than a mean, a norm and batch norm's own
    per-channel kernel): forward, mean, x - mean and its norm, then torch's fused normalization with the
    merged statistics; backward, x - mean, two per-channel sums, one fused per-channel affine map and one
    multiply-add.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: Optional[torch.Tensor],
        bias: Optional[torch.Tensor],
        eps: float,
        comm: Communicator,
    ) -> Any:
        dims = [d for d in range(x.dim()) if d != 1]
        count = x.numel() // x.shape[1]
        local_mean = x.mean(dims)
        local_m2 = torch.linalg.vector_norm(x - local_mean.view(_shape(x)), dim=dims) ** 2
        mine = torch.cat([local_mean.new_tensor([float(count)]), local_mean, local_m2])
        table = (
            comm.allgather(mine.unsqueeze(0).contiguous(), sizes=[1] * comm.size)
            if comm.size > 1
            else mine.unsqueeze(0)
        )
        counts, means, m2s = table[:, 0], table[:, 1 : 1 + x.shape[1]], table[:, 1 + x.shape[1] :]
        total = counts.sum()
        mean = (counts[:, None] * means).sum(0) / total
        m2 = (m2s + counts[:, None] * (means - mean) ** 2).sum(0)
        var = m2 / total
        invstd = torch.rsqrt(var + eps)
        y = F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)  # normalize with the whole image's statistics
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.comm, ctx.total, ctx.has_bias = comm, float(total), bias is not None
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var, total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> Any:
        x, weight, mean, invstd = ctx.saved_tensors
        dims = [d for d in range(x.dim()) if d != 1]
        centred = x - mean.view(_shape(x))
        sum_dy = grad.sum(dims)
        sum_dy_centred = (grad * centred).sum(dims)
        sums = torch.cat([sum_dy, sum_dy_centred])
        if ctx.comm.size > 1:
            ctx.comm.allreduce(sums)
        c = x.shape[1]
        g_dy, g_dy_centred = sums[:c], sums[c:]
        scale = invstd if weight is None else invstd * weight
        # grad_x = scale * (grad - g_dy / N - xhat * g_dy_xhat / N), with xhat = centred * invstd
        shift = -scale * g_dy / ctx.total
        slope = -scale * invstd * invstd * g_dy_centred / ctx.total
        grad_x = _affine(centred, slope, shift).addcmul_(grad, scale.view(_shape(x)))
        sum_dy_xhat = sum_dy_centred * invstd  # this slab's share of the weight gradient
        grad_w = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = sum_dy if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None


def _affine(x: torch.Tensor, slope: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Per channel x * slope + shift, in one pass: batch norm's inference kernel with mean 0, variance 1, eps 0."""
    return F.batch_norm(x, torch.zeros_like(slope), torch.ones_like(slope), slope, shift, False, 0.0, 0.0)


def _shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


class SpatialBatchNorm(SpatialLayer):
    """BatchNorm1d/2d/3d whose training statistics cover the whole image (all slabs), like one process."""

    weight: Optional[nn.Parameter]
    bias: Optional[nn.Parameter]
    running_mean: Optional[torch.Tensor]
    running_var: Optional[torch.Tensor]
    num_batches_tracked: Optional[torch.Tensor]

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, place: Placement):
        super().__init__(place)
        self.num_features, self.eps, self.momentum = bn.num_features, bn.eps, bn.momentum
        self.affine, self.track_running_stats = bn.affine, bn.track_running_stats
        self.weight, self.bias = bn.weight, bn.bias
        self.register_buffer("running_mean", bn.running_mean)
        self.register_buffer("running_var", bn.running_var)
        self.register_buffer("num_batches_tracked", bn.num_batches_tracked)
        self.plain = type(bn).__name__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        use_batch = self.training or not self.track_running_stats
        if not use_batch:
            assert self.running_mean is not None and self.running_var is not None
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        y, mean, var, total = _BatchNormFunction.apply(x, self.weight, self.bias, self.eps, self.comm)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                n = float(total)
                assert self.running_mean is not None and self.running_var is not None
                self.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
                self.running_var.mul_(1 - momentum).add_(var * (n / max(n - 1, 1.0)), alpha=momentum)
        return y

    def extra_repr(self) -> str:
        return f"{self.plain}({self.num_features}), statistics over {self.comm.size} slabs"


class SpatialGlobalPool(SpatialLayer):
    """Adaptive avg/max pooling to one row along the split dimension: slabs reduced, output replicated."""

    spatial_params = False

    def __init__(self, pool: nn.Module, place: Placement):
        super().__init__(place)
        name = place.name
        self.pool = pool
        self.is_max = type(pool).__name__.startswith("AdaptiveMax")
        if getattr(pool, "return_indices", False):
            raise ValueError(
                f"{name} ({type(pool).__name__}): return_indices=True is not supported by spatial parallelism"
            )
        size = pool.output_size  # type: ignore[attr-defined]
        sizes = list(size) if isinstance(size, (tuple, list)) else [size] * int(type(pool).__name__[-2])
        self.reduces = all(sizes[d - 2] == 1 for d in self.split_dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = self.split_dims
        if not self.reduces:
            return self.pool(self.gather_axes(x))
        if self.is_max:
            peaks = gather(x.amax(dims, keepdim=True), self.comm, dims[0])  # one value per rank along dims[0]
            return self.pool(peaks.amax(dims[0], keepdim=True))
        extents, _ = self.extents(x)
        return self.pool(sum_over_slabs(x.sum(dims, keepdim=True), self.comm) / math.prod(extents))

    def extra_repr(self) -> str:
        how = "slabs reduced" if self.reduces else "slabs gathered"
        size = self.pool.output_size  # type: ignore[attr-defined]
        return f"{type(self.pool).__name__}({size}), {how}, output replicated"


class SpatialFlatten(SpatialLayer):
    """Flatten over the split dimension: the slabs are gathered, the output is replicated."""

    spatial_params = False

    def __init__(self, flatten: nn.Flatten, place: Placement):
        super().__init__(place)
        self.flatten = flatten

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.flatten(self.gather_axes(x))

    def extra_repr(self) -> str:
        return "slabs gathered, output replicated"
