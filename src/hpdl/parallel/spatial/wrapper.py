"""`SpatialParallel`: every rank holds a slab of every activation of a CNN, and the whole model's weights.

    comm = hpdl.init()
    model = SpatialParallel(cnn, comm, dim=2)        # converts cnn's layers in place
    loss = loss_fn(model(shard(image, comm)), label)  # a slab in, the replicated head's output out
    loss.backward()                                   # weight gradients = one process's on the whole image
    optimizer.step()

    model = SpatialParallel(cnn, comm, dim=(2, 3), grid=(2, 2))   # 4 ranks, each a block of height x width
    loss = loss_fn(model(model.shard(image)), label)

Convolution, pooling and batch norm gradients of one slab are that slab's
share of the whole image's gradient: they are summed over the group (in
buckets, overlapped with backward, by hpdl's `GradientReducer`, as in
`DataParallel`). The layers after the global pool run replicated and
their gradients are already whole. With `grad_comm` (a group that contains
`comm`'s ranks and their data-parallel peers: sample + spatial
parallelism) gradients are averaged over the samples too.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
from torch import nn

from hpdl.comm.base import Communicator
from hpdl.parallel.data.buckets import GradientReducer
from hpdl.parallel.data.data_parallel import broadcast_tensors
from hpdl.parallel.shared.gradient_sync import LocalAccumulation
from hpdl.parallel.spatial.convert import convert
from hpdl.parallel.spatial.extent import SpatialContext, slab_sizes
from hpdl.parallel.spatial.grid import axis_groups, normalize_split
from hpdl.parallel.spatial.halo import HaloStats
from hpdl.parallel.spatial.slabs import gather, shard

__all__ = ["SpatialParallel"]


class SpatialParallel(LocalAccumulation, nn.Module):
    """Wrap `module` so that each rank of `comm` computes its slab of every activation along `dim`.

    Arguments:
        module: a plain CNN (`nn.Sequential` or a module whose submodules
            are registered in execution order); converted in place.
        comm: the spatial group (every rank holds one slab of the image).
        dim: the split dimension (2: height of NCHW, depth of NCDHW), or a
            tuple of them for a grid split ((2, 3): height x width blocks).
        grid: ranks per split dimension of a tuple `dim` (their product is
            `comm.size`; default the most even grid, 2 x 2 for 4 ranks).
        grad_comm: the group over which gradients are averaged (default:
            `comm`); for dp x sp, the group of all dp x sp ranks.
        bucket_mb: megabytes per gradient bucket.
        overlap: compute each layer's interior while its halos are in flight.
        gather_output: gather the output slabs into the whole tensor on every
            rank (for a model without a head: the first stage of a pipeline
            whose later stages run whole).

    The forward takes this rank's slab (`shard`) and returns, after a global
    pool / Flatten, the replicated head's output; a model without a head
    returns this rank's output slab (`gather` puts it together).
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        dim: Union[int, Sequence[int]] = 2,
        *,
        grid: Optional[Sequence[int]] = None,
        grad_comm: Optional[Communicator] = None,
        bucket_mb: float = 25.0,
        overlap: bool = True,
        gather_output: bool = False,
    ):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"SpatialParallel wraps an nn.Module, got {type(module).__name__}")
        self.comm, self.dim, self.gather_output = comm, dim, bool(gather_output)
        self.dims, self.grid = normalize_split(
            dim, grid if not isinstance(dim, int) else None, comm.size, "SpatialParallel"
        )
        if isinstance(dim, int) and grid is not None and tuple(grid) != (comm.size,):
            raise ValueError(f"SpatialParallel: grid={tuple(grid)!r} needs a tuple dim, one split dim per factor")
        self.axes = list(zip(self.dims, axis_groups(comm, self.grid)))
        """(split dimension, its group) per grid axis."""
        self.grad_comm = grad_comm if grad_comm is not None else comm
        if self.grad_comm.size % comm.size:
            raise ValueError(
                f"SpatialParallel: grad_comm has {self.grad_comm.size} ranks, not a multiple of the spatial "
                f"group's {comm.size}"
            )
        self.context = SpatialContext()
        self.module = module
        self.layers = convert(module, comm, self.dims[0], self.context, self.axes)
        for _, layer in self.layers:
            layer.overlap = overlap
        spatial = {id(p) for _, layer in self.layers if layer.spatial_params for p in layer.parameters()}
        self._hooks = []
        if comm.size > 1:
            scale = float(comm.size)
            for p in module.parameters():
                if id(p) in spatial and p.requires_grad:
                    # a slab's share x P, then the group average = the sum of the shares
                    self._hooks.append(p.register_hook(lambda g, s=scale: g * s))
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        self.reducer = GradientReducer(params, self.grad_comm, bucket_mb=bucket_mb, op="avg")
        broadcast_tensors(self.grad_comm, [*module.parameters(), *module.buffers()], root=0)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if x.dim() <= max(self.dims):
            raise ValueError(f"SpatialParallel: input of shape {tuple(x.shape)} has no dimension {self.dim} to split")
        shape = list(x.shape)
        for d, group in self.axes:
            shape[d] = sum(slab_sizes(x.shape[d], group, x.device))
        self.context.begin(tuple(shape))
        out = self.module(x, *args, **kwargs)
        if self.gather_output:
            if not isinstance(out, torch.Tensor) or out.dim() <= max(self.dims):
                raise ValueError(
                    "SpatialParallel: gather_output needs the module to return a tensor with the split dimension"
                )
            for d, group in self.axes:
                out = gather(out, group, d)
        return out

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's slab (or grid block) of a whole input `x`."""
        return shard(x, self.comm, self.dim, None if isinstance(self.dim, int) else self.grid)

    def close(self) -> None:
        """Release the per-axis groups a grid split made (a one-dimension split makes none; `comm` stays open)."""
        for _, group in self.axes:
            if group is not self.comm:
                group.close()

    @property
    def halo_stats(self) -> HaloStats:
        """Halo traffic and waiting time summed over the layers (and per layer in `.layers`)."""
        total = HaloStats()
        for name, layer in self.layers:
            total.add(layer.stats)
            total.layers[name] = layer.stats
        return total

    def reset_halo_stats(self) -> None:
        for _, layer in self.layers:
            layer.stats = HaloStats()

    def set_overlap(self, overlap: bool) -> None:
        for _, layer in self.layers:
            layer.overlap = overlap

    def describe(self, rows: int, ranks: Optional[int] = None, axis: int = 0) -> str:
        """A text picture of each rank's slab, output rows and halos at every window layer, for `rows` input rows
        (of a grid split: along grid axis `axis`, over that axis's ranks)."""
        from hpdl.parallel.spatial.describe import describe_layers

        if not 0 <= axis < len(self.axes):
            raise ValueError(f"SpatialParallel.describe: axis={axis} is not one of the split's {len(self.axes)} axes")
        parts = self.axes[axis][1].size if ranks is None else ranks
        return describe_layers(self.layers, rows, parts, axis)

    def __repr__(self) -> str:
        layers = len(self.layers)
        split = f"dim={self.dim}" if len(self.axes) == 1 else f"dim={self.dims}, grid={self.grid}"
        return f"SpatialParallel(ranks={self.comm.size}, {split}, layers={layers}, module={self.module!r})"
