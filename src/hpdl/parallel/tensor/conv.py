"""Filter and channel parallel convolutions (Dryden et al., SC19): the convolutional column/row-parallel layers.

    FilterParallelConv   the filters (output channels) split: each rank computes its output channels from the
                         whole input; with `gather_output` the channels are gathered (like ColumnParallelLinear)
    ChannelParallelConv  the input channels split: each rank convolves its input channels with its slice of
                         every filter and the partial sums are added (one allreduce; like RowParallelLinear)

A filter layer followed by a channel layer costs one allreduce forward and
one backward for the pair, nothing in between. They are the tensor-parallel
styles "filter", "channel" and "filter_gather" of `parallelize`, and
`hpdl.parallel.spatial` exports them beside its spatial layers. Parameters keep the plain
layer's names, with `tp_shards` saying where each slice sits in the full
tensor, so `hpdl.parallel.tensor.full_state_dict` assembles the plain model.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hpdl.comm.base import Communicator
from hpdl.parallel.tensor.comm_ops import copy_to_tp, gather_from_tp, reduce_from_tp
from hpdl.parallel.tensor.shards import TPShard

__all__ = ["FilterParallelConv", "ChannelParallelConv"]

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _check(conv: Any, what: str, extent: int, comm: Communicator, layer: str) -> None:
    if not isinstance(conv, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        raise TypeError(f"{layer} is built from nn.Conv1d/2d/3d, got {type(conv).__name__}")
    if conv.groups != 1:
        raise ValueError(f"{layer}: groups={conv.groups} is not supported (split a grouped conv by groups instead)")
    if conv.padding_mode != "zeros":
        raise ValueError(f"{layer}: padding_mode={conv.padding_mode!r} is not supported; use zeros")
    if extent % comm.size:
        raise ValueError(f"{layer}: {what} ({extent}) must be divisible by the group size ({comm.size})")


class _ParallelConv(nn.Module):
    def __init__(self, conv: nn.modules.conv._ConvNd, comm: Communicator):
        super().__init__()
        self.comm, self.nd = comm, len(conv.kernel_size)
        self.stride, self.padding, self.dilation = conv.stride, conv.padding, conv.dilation
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: Any) -> torch.Tensor:
        return _CONV[self.nd](x, weight, bias, self.stride, self.padding, self.dilation)  # type: ignore[arg-type]


class FilterParallelConv(_ParallelConv):
    """This rank's output channels of `conv` (weight rows split over `comm`)."""

    bias: Optional[nn.Parameter]

    def __init__(self, conv: nn.modules.conv._ConvNd, comm: Communicator, *, gather_output: bool = False):
        _check(conv, "out_channels", conv.out_channels, comm, "FilterParallelConv")
        super().__init__(conv, comm)
        self.gather_output = bool(gather_output)
        full = tuple(conv.weight.shape)
        self.tp_shards = {"weight": TPShard(full, 0, comm.rank, comm.size)}
        self.weight = nn.Parameter(self.tp_shards["weight"].take(conv.weight.detach()).clone())
        if conv.bias is not None:
            self.tp_shards["bias"] = TPShard((conv.out_channels,), 0, comm.rank, comm.size)
            self.bias = nn.Parameter(self.tp_shards["bias"].take(conv.bias.detach()).clone())
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(copy_to_tp(x, self.comm), self.weight, self.bias)
        return gather_from_tp(y, self.comm, dim=1) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"{self.in_channels} -> {self.out_channels} ({self.weight.shape[0]} here), group of {self.comm.size}"


class ChannelParallelConv(_ParallelConv):
    """`conv` with its input channels split over `comm`; the partial outputs are summed (one allreduce)."""

    def __init__(self, conv: nn.modules.conv._ConvNd, comm: Communicator, *, input_is_parallel: bool = True):
        _check(conv, "in_channels", conv.in_channels, comm, "ChannelParallelConv")
        super().__init__(conv, comm)
        self.input_is_parallel = bool(input_is_parallel)
        self.tp_shards = {"weight": TPShard(tuple(conv.weight.shape), 1, comm.rank, comm.size)}
        self.weight = nn.Parameter(self.tp_shards["weight"].take(conv.weight.detach()).clone())
        self.bias = nn.Parameter(conv.bias.detach().clone()) if conv.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            width = self.weight.shape[1]
            x = copy_to_tp(x, self.comm).narrow(1, self.comm.rank * width, width)
        y = reduce_from_tp(self.conv(x, self.weight, None), self.comm)
        return y if self.bias is None else y + self.bias.view([1, -1] + [1] * self.nd)

    def extra_repr(self) -> str:
        return f"{self.in_channels} ({self.weight.shape[1]} here) -> {self.out_channels}, group of {self.comm.size}"
