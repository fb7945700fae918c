"""Spatial parallelism (halo exchange) and channel/filter parallelism for CNNs on images too large for one rank.

Every rank holds a slab of each activation along one dimension and the
whole model's weights; sliding-window layers exchange halos with their
neighbours (forward and backward, overlapped with the interior), batch norm
reduces its statistics over the slabs, a global pool or Flatten ends the
split and the head runs replicated. See docs/spatial.md.
"""

from hpdl.parallel.spatial.halo import HaloStats
from hpdl.parallel.spatial.partition import even_split, plan_windows
from hpdl.parallel.spatial.slabs import gather, shard, sum_over_slabs
from hpdl.parallel.spatial.wrapper import SpatialParallel
from hpdl.parallel.tensor.conv import ChannelParallelConv, FilterParallelConv

__all__ = [
    "SpatialParallel",
    "shard",
    "gather",
    "sum_over_slabs",
    "even_split",
    "plan_windows",
    "HaloStats",
    "FilterParallelConv",
    "ChannelParallelConv",
]
