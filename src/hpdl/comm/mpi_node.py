"""The mpi backend's use of the node's shared-memory engine (shm.py), and the size gates it sets.

The engine starts at the first collective above its size threshold, which
every rank reaches with the same size, so that its collective set-up is
reached together. Its thresholds decide, per operation, where the fast paths
stop (`_open_shm_gates`): below them a call keeps the fast path, and on two
ranks the pair's messages.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from hpdl.comm import fusion, shm
from hpdl.comm.base import own_op
from hpdl.comm.mpi_base import INT_COUNT, MpiBase
from hpdl.comm.mpi_library import MPI, buffer, move_type, node_comm, reduce_op
from hpdl.comm.progress import describe_laggards
from hpdl.comm.work import Work
from hpdl.errors import CommTimeoutError

__all__ = ["NodeEngine"]


class NodeEngine(MpiBase):
    """Starting the engine, routing a collective to it, its shared buffers, and the gates its thresholds set."""

    def _open_shm_gates(self, closed: bool = False) -> None:
        """Per operation, the smallest message that may take the shared-memory path (every fast path compares its
        own: one op's low threshold must not send another op's small messages down the general path). The lower
        threshold (zero copy) only counts once shared buffers exist: until then no call can be zero-copy, and
        ordinary tensors up to the higher one keep the fast path."""
        buffers = self._node is not None and self._node.has_buffers
        gate = {
            op: math.inf if closed else float(low if buffers else high)
            for op, (low, high) in self._shm_thresholds.items()
        }
        self._shm_smallest = min(gate.values())
        # Two ranks: below these, messages (pairs.py), never on the exit channel. The fast paths stop at the
        # gates; past them a call the shared-memory engine does not take (an ordinary tensor between the
        # thresholds) goes as messages from the general path too.
        paired = self._pair is not None and not closed
        limit = self._pair_limits
        self._pair_allreduce_below = limit["allreduce"] if paired else 0
        self._pair_allgather_below = limit["allgather"] if paired else 0
        self._pair_reduce_scatter_below = limit["reduce_scatter"] if paired else 0
        self._pair_broadcast_below = limit["broadcast"] if paired else 0
        # The fast paths also leave messages that need more than an int count to the general path.
        self._fast_allreduce_below = min(gate["allreduce"], INT_COUNT)
        self._fast_allgather_below = min(gate["allgather"], INT_COUNT)
        # The counted reduce_scatter's window is the general path's, unless messages cover it (two ranks: 2 MiB
        # of input took 278 us through the general path's Python wait, 210 us on the fast path).
        low, high = self._counted_reduce_scatter
        covered = self._pair_reduce_scatter_below * self.size >= min(high, gate["reduce_scatter"])
        window = low if low < high and not covered else math.inf
        self._fast_reduce_scatter_below = min(gate["reduce_scatter"], INT_COUNT, window)
        self._fast_broadcast_below = min(gate["broadcast"], INT_COUNT)

    # Shared memory inside the node (see shm.py): started at the first large collective,
    # which every rank reaches with the same size, so the collective set-up is reached together.
    def _shared_memory(self, op: str, nbytes: int, t: torch.Tensor, called: str = "") -> Optional[shm.NodeCollectives]:
        """The node's shared-memory engine when `op` on `t` should use it (the same answer on every rank).

        Ordinary tensors of at least the larger threshold always go through it
        (copied in); between the thresholds only when every rank's tensor is
        already in a shared window (zero copy), which the ranks agree on first.
        `called`: what the caller called, for the engine's start-up error, when it is not `op`.
        """
        if nbytes < self._shm_smallest:
            return None
        with_buffers, ordinary = self._shm_thresholds[op]
        if nbytes < with_buffers or not t.is_cpu:
            return None
        if nbytes < ordinary and (self._node is None or not self._node.has_buffers):
            return None
        if self._node is None and self.shm_status.startswith("not started"):
            self._start_shared_memory(called or op)
        if self._node is None or (self._cross is not None and op != "allreduce"):
            return None  # across nodes only the allreduce is hierarchical; the rest stay with MPI
        if nbytes < ordinary and not self._node.all_zero_copy(t):
            return None
        return self._node

    def _start_shared_memory(self, op: str) -> None:
        self.shm_status = "starting"  # the set-up's own small collectives go through MPI
        # Every rank must be here before the unbounded MPI set-up calls below.
        try:
            self._barrier(self._seq).wait()
        except CommTimeoutError as exc:  # said as the caller's collective, which this barrier starts
            raise CommTimeoutError(
                f"{exc} This barrier starts the node's shared-memory engine at {op} #{self._seq}, the first "
                "collective above its size threshold on this communicator: every rank must make the same call "
                "here.",
                op=op,
                seq=self._seq,
                missing=exc.missing,
            ) from None
        node = node_comm(self.mpi_comm)
        local = node.Get_size()
        wanted = int(self.shared_memory)
        free = shm.available_bytes()
        free = shm.NEVER if free is None else free
        extremes = torch.tensor([local, -local, -wanted, -free], dtype=torch.int64)  # max, -min, -min, -min
        self._allreduce(extremes, "max", -1).wait()
        free = -int(extremes[3])  # the least any rank sees (the same directory on a node; nodes may differ)
        segment = shm.fitting_segment(shm.segment_bytes(), free, local)
        if extremes[2] != -1:  # off on at least one rank: off everywhere
            self.shm_status = "off (HPDL_SHM=0 or comm.shared_memory = False): plain MPI"
        elif local == 1:
            self.shm_status = "off: one rank on this node, plain MPI"
        elif int(extremes[0]) != -int(extremes[1]):
            self.shm_status = "off: nodes hold different numbers of ranks, plain MPI"
        elif not segment:
            self.shm_status = f"off: {shm.short_of_shared_memory(free)}; plain MPI"
        else:
            members = node.Get_group().Translate_ranks(list(range(local)), self.mpi_comm.Get_group())
            try:
                self._node = shm.NodeCollectives(
                    node, members, lambda: self.timeout, self.__repr__, self._mark_broken, segment=segment,
                    watch=self._watch_in_node, positions=self._positions_in_node,
                )  # fmt: skip
            except MPI.Exception as exc:
                self.shm_status = f"off: shared window could not be allocated ({exc}), plain MPI"
            else:
                nodes = self.size // local
                if nodes > 1:
                    self._cross = self.mpi_comm.Split(node.Get_rank(), self.rank)
                self.shm_status = (
                    f"on: {local} ranks per node share {segment / 2**20:.3g} MB each"
                    + (
                        f", not {shm.segment_bytes() / 2**20:.3g}: {shm.short_of_shared_memory(free)}"
                        if segment < shm.segment_bytes()
                        else ""
                    )
                    + (f"; hierarchical allreduce across {nodes} nodes" if nodes > 1 else "")
                )
                return
        node.Free()

    def _mark_broken(self) -> None:
        self._broken = True

    def _watch_in_node(self) -> None:
        """The shared-memory engine's look at the peers while a meeting waits: as `Work.wait`'s (the collective is
        this rank's latest, and its progress post says which op it is)."""
        self._check_peers("", self._seq)

    def _positions_in_node(self) -> str:
        """Where every rank is, for the shared-memory engine's timeout error (as `_timeout_error` says it)."""
        states = self._progress.read(min(2.0, self.timeout))
        return describe_laggards(states, self.rank, self._seq, own_op(states, self.rank, self._seq, ""))[0]

    def _across_nodes(self, t: torch.Tensor, op: str) -> None:
        """Allreduce one node-reduced slice among the ranks with this local rank on every node."""
        request = self._cross.Iallreduce(MPI.IN_PLACE, buffer(t, move_type(t, "allreduce")), reduce_op(t, op))
        Work(self, "allreduce (across nodes)", self._seq, request.Test).wait()

    def shared_buffer(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        node = self._shared_memory("allreduce", shm.NEVER, torch.empty(0), called="shared_buffer")
        if node is None:
            return super().shared_buffer(numel, dtype)
        made = node.shared_buffer(numel, dtype)
        self._open_shm_gates()  # zero-copy sizes now leave the fast paths (every rank made one)
        return made

    def peer_buffer(self, buffer: torch.Tensor, rank: int) -> Optional[torch.Tensor]:
        if self._node is None or rank not in self._node.ranks:
            return None
        return self._node.peer_view(buffer, self._node.ranks.index(rank))

    def fence_shared(self) -> None:
        if self._node is not None:
            self._node.fence()

    def _use_shm_thresholds(self, op: str, zero_copy: int, ordinary: int) -> None:
        """Where `op` takes the shared-memory path from now on (bytes: shared buffers, ordinary tensors), as
        `hpdl tune` does to time each path. Every rank must set the same numbers before its next `op`."""
        self._shm_thresholds[op] = (zero_copy, ordinary)
        self._open_shm_gates()

    def _allreduce_buckets(
        self, buckets: list[fusion.Bucket], op: str, seq: int, async_op: bool
    ) -> tuple[list[Work], list[fusion.Bucket]]:
        """A blocking caller's buckets from `shm.fused_threshold()` go through shared memory straight from and into
        their tensors (no flat buffer: two copies of everything less); the others are packed for MPI. Every
        bucket that travels in its flat buffer is packed before any result is written back, as on MPI alone (a
        tensor given twice, or overlapping another, is read once, before it changes)."""
        nodes = [None if async_op else self._shared_memory_for_bucket(bucket) for bucket in buckets]
        for bucket, node in zip(buckets, nodes):
            if node is None or not bucket.packs_ranges:
                bucket.fill()
        across = self._across_nodes if self._cross is not None else None
        divisor = self.size if op == "avg" else 1
        packed = []
        for bucket, node in zip(buckets, nodes):
            if node is None:
                packed.append(bucket)
            elif bucket.packs_ranges:
                node.allreduce_packed(bucket, op, across, divisor)
            else:  # not compiled, or tensors autograd tracks or that share memory: the route through the flat buffer
                node.allreduce(bucket.flat, op, across, divisor)
                bucket.unpack()
        works = self._allreduce_flat([bucket.flat for bucket in packed], op, seq, async_op)
        return works, packed

    def _shared_memory_for_bucket(self, bucket: fusion.Bucket) -> Optional[shm.NodeCollectives]:
        """The node's engine for a fusion bucket of several CPU tensors from the fused threshold (the same answer on
        every rank: it depends only on the call's sizes); one tensor alone is an ordinary allreduce."""
        if len(bucket.targets) < 2 or bucket.flat.nbytes < self._fused_shm_min or not bucket.flat.is_cpu:
            return None
        if self._node is None and self.shm_status.startswith("not started"):
            self._start_shared_memory("allreduce_coalesced")
        return self._node
