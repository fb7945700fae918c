"""Alpha-beta costs of collectives over a group of devices placed on one or more nodes.

For a group of n devices on one link level (latency alpha, bandwidth B per
device and direction), S the bytes of the full buffer (Thakur, Rabenseifner
and Gropp, "Optimization of Collective Communication Operations in MPICH",
2005; Patarasuk and Yuan 2009 for the ring's optimality):

    ring allreduce        2 (n-1) alpha + 2 (n-1)/n S / B
    tree allreduce        2 ceil(log2 n) alpha + 2 S / B      (pipelined double binary tree, as NCCL)
    reduce-scatter        (n-1) alpha + (n-1)/n S / B          (ring; S is the unreduced full size)
    allgather             (n-1) alpha + (n-1)/n S / B          (ring; S is the gathered full size)
    point-to-point        alpha + S / B

An allreduce takes the cheaper of ring and tree, as NCCL and MPI libraries
choose by size. A group spanning several nodes with k members per node runs
hierarchically (intra-node reduce-scatter, inter-node collective on S/k,
intra-node allgather), with one NIC per device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpdl.plan.cluster import Cluster, Link

__all__ = ["Group", "ring_allreduce", "tree_allreduce", "allreduce", "reduce_scatter", "allgather", "p2p", "group"]


@dataclass(frozen=True)
class Group:
    """A process group: `size` devices, `per_node` of them on each node it spans."""

    size: int
    per_node: int

    @property
    def nodes(self) -> int:
        return math.ceil(self.size / self.per_node)


def group(cluster: Cluster, size: int, stride: int) -> Group:
    """The group of `size` ranks `stride` apart (rank r, r+stride, ...), placed node by node in rank order."""
    g = cluster.devices_per_node
    per_node = max(1, min(size, g // stride)) if stride < g else 1
    return Group(size, per_node)


def ring_allreduce(n: int, nbytes: float, link: Link) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.latency_s + 2 * (n - 1) / n * nbytes / link.bandwidth_Bps


def tree_allreduce(n: int, nbytes: float, link: Link) -> float:
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * link.latency_s + 2 * nbytes / link.bandwidth_Bps


def _flat_allreduce(n: int, nbytes: float, link: Link) -> float:
    return min(ring_allreduce(n, nbytes, link), tree_allreduce(n, nbytes, link))


def _ring_half(n: int, nbytes: float, link: Link) -> float:
    """Reduce-scatter or allgather on a ring of n."""
    if n <= 1:
        return 0.0
    return (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bandwidth_Bps


def allreduce(cluster: Cluster, g: Group, nbytes: float) -> float:
    """Seconds for an allreduce of `nbytes` over group `g` (hierarchical when it spans nodes)."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    if g.nodes <= 1:
        return _flat_allreduce(g.size, nbytes, cluster.intra)
    k = g.per_node
    return (
        _ring_half(k, nbytes, cluster.intra)
        + _flat_allreduce(g.nodes, nbytes / k, cluster.inter)
        + _ring_half(k, nbytes, cluster.intra)
    )


def reduce_scatter(cluster: Cluster, g: Group, nbytes: float) -> float:
    """Seconds for a reduce-scatter of a `nbytes` buffer over `g` (each member keeps nbytes / size)."""
    if g.size <= 1 or nbytes <= 0:
        return 0.0
    if g.nodes <= 1:
        return _ring_half(g.size, nbytes, cluster.intra)
    k = g.per_node
    return _ring_half(k, nbytes, cluster.intra) + _ring_half(g.nodes, nbytes / k, cluster.inter)


def allgather(cluster: Cluster, g: Group, nbytes: float) -> float:
    """Seconds to gather a `nbytes` buffer (the full result) over `g`: the mirror of reduce-scatter."""
    return reduce_scatter(cluster, g, nbytes)


def p2p(link: Link, nbytes: float) -> float:
    """Seconds for one message of `nbytes`."""
    return link.time(nbytes) if nbytes > 0 else 0.0
