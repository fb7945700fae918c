"""Replace a plain CNN's layers by their spatial versions, in place, refusing what cannot be split.

Modules are visited in registration order, which for `nn.Sequential` and
for the usual CNN classes (torchvision's ResNet: convolutions, then
`avgpool`, then `fc`) is execution order. Until a layer that reduces the
split dimension (a global pool, a Flatten) the network is *spatial*: every
leaf must be a convolution, pooling, batch norm or an element-wise layer,
and anything else is an error naming it, before any compute. After it the
network is *replicated*: every rank runs the same layers on the same data.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from hpdl.comm.base import Communicator
from hpdl.parallel.spatial.extent import SpatialContext
from hpdl.parallel.spatial.layers import (
    Placement,
    SpatialBatchNorm,
    SpatialConv,
    SpatialFlatten,
    SpatialGlobalPool,
    SpatialLayer,
    SpatialPool,
)

__all__ = ["convert", "ELEMENTWISE"]

ELEMENTWISE: tuple[type, ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardtanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Softplus,
    nn.Identity,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
)
"""Leaves that act on each element (or each channel) alone: slabs pass through them untouched."""

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
GLOBAL_POOLS = (
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
)


class _State:
    def __init__(self, axes: Optional[Sequence[tuple[int, Communicator]]]) -> None:
        self.axes = axes
        self.replicated = False
        self.next_id = 0
        self.layers: list[tuple[str, SpatialLayer]] = []


def convert(
    module: nn.Module,
    comm: Communicator,
    dim: int,
    context: Optional[SpatialContext] = None,
    axes: Optional[Sequence[tuple[int, Communicator]]] = None,
) -> list[tuple[str, SpatialLayer]]:
    """Swap `module`'s layers for spatial ones in place; return (name, layer) of each spatial layer made.

    Raises ValueError naming the first layer that cannot run on slabs.
    `module` itself may be a single layer only inside a container (wrap it
    in `nn.Sequential`). `axes`: (dim, group) per axis of a grid split, `comm` the whole grid.
    """
    if not isinstance(dim, int) or dim < 2:
        raise ValueError(
            f"spatial: dim={dim!r} must be a spatial dimension (2 for the height of NCHW / the depth of NCDHW)"
        )
    state = _State(axes)
    _convert_children(module, "", comm, dim, context, state)
    return state.layers


def _convert_children(
    parent: nn.Module, prefix: str, comm: Communicator, dim: int, context: Optional[SpatialContext], state: _State
) -> None:
    for child_name, child in list(parent.named_children()):
        name = f"{prefix}{child_name}"
        replacement = _convert_one(child, name, comm, dim, context, state)
        if replacement is not None:
            setattr(parent, child_name, replacement)
            state.layers.append((name, replacement))


def _convert_one(
    module: nn.Module, name: str, comm: Communicator, dim: int, context: Optional[SpatialContext], state: _State
) -> Optional[SpatialLayer]:
    if state.replicated:
        return None
    if isinstance(module, SpatialLayer):
        raise ValueError(f"spatial: {name} is already a spatial layer; wrap the plain model once")
    made: Optional[SpatialLayer] = None
    place = Placement(comm, dim, name, state.next_id, context, state.axes)
    if isinstance(module, CONVS):
        made = SpatialConv(module, place)
    elif isinstance(module, POOLS):
        made = SpatialPool(module, place)
    elif isinstance(module, NORMS):
        made = SpatialBatchNorm(module, place)
    elif isinstance(module, GLOBAL_POOLS):
        made = SpatialGlobalPool(module, place)
        state.replicated = True
    elif isinstance(module, nn.Flatten):
        made = SpatialFlatten(module, place)
        state.replicated = True
    elif isinstance(module, ELEMENTWISE):
        return None
    elif isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)) or (
        type(module).__module__.split(".")[0] != "torch" and len(list(module.children())) > 0
    ):
        _convert_children(module, f"{name}.", comm, dim, context, state)
        return None
    else:
        raise ValueError(
            f"spatial: layer {name!r} ({type(module).__name__}) cannot run on slabs of dimension {dim}: spatial "
            "parallelism splits convolutions, pooling, batch norm and element-wise layers; put it after a global "
            "pool or Flatten (it then runs replicated), or run it outside SpatialParallel"
        )
    state.next_id += 1
    return made
