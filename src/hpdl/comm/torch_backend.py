"""The `torch` backend: collectives through torch.distributed (gloo on CPU, NCCL on GPU).

hpdl adds what torch.distributed leaves to the user: one call for uneven
allgathers, `avg` on every engine, bounded waits whose errors name the
missing ranks, and a clean exit (a gloo job that ends without a barrier and
`destroy_process_group()` can abort at exit with torch 2.13).
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from hpdl.comm.base import Communicator
from hpdl.comm.progress import ProgressBoard, State
from hpdl.comm.work import Work
from hpdl.errors import CommError

__all__ = ["TorchCommunicator"]

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,  # divided afterwards: not every engine has AVG
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "prod": dist.ReduceOp.PRODUCT,
}


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


class StoreBoard(ProgressBoard):
    """Progress reports through the rendezvous key-value store, written only when a wait times out.

    A per-collective store write would cost a network round trip, so ranks
    keep their progress locally and publish it once they are stuck; ranks
    that never publish within the grace period are the ones not waiting.
    """

    def __init__(self, store: Any, prefix: str, rank: int, size: int):
        self._store = store
        self._prefix = prefix
        self._rank = rank
        self._size = size
        self._state: tuple[int, str] = (0, "")

    def post(self, seq: int, op: str) -> None:
        self._state = (seq, op)
        if op in ("finalize", "left"):  # once per communicator: the peers still waiting must see it without asking
            try:
                self._publish()
            except (RuntimeError, OSError):  # the store's host has gone already: nobody is left to tell
                pass

    def _publish(self) -> None:
        self._store.set(f"{self._prefix}/{self._rank}", f"{self._state[0]}:{self._state[1]}")

    def read(self, timeout: float) -> list[State]:
        self._publish()
        keys = [f"{self._prefix}/{r}" for r in range(self._size)]
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline and not self._store.check(keys):
            time.sleep(0.05)
        states: list[State] = []
        for key in keys:
            if self._store.check([key]):
                seq, _, op = self._store.get(key).decode().partition(":")
                states.append((int(seq), op))
            else:
                states.append(None)
        return states


class TorchCommunicator(Communicator):
    """A communicator over a torch.distributed process group (the default group or a sub-group)."""

    backend = "torch"

    def __init__(
        self,
        group: Any,
        store: Any,
        *,
        local_rank: int,
        local_size: int,
        timeout: float,
        debug: bool,
        members: Optional[list[int]] = None,
        name: str = "world",
    ):
        # torch orders a group's ranks by global rank; `members` (global ranks in
        # this communicator's order, set by `split` keys) may differ, so blocks
        # are permuted between our order and the group's (`_slot`).
        size = dist.get_world_size(group)
        self._global = members if members is not None else list(range(size))
        ordered = sorted(self._global)
        self._slot = [ordered.index(g) for g in self._global]
        self._permuted = self._slot != list(range(size))
        super().__init__(
            rank=self._global.index(dist.get_rank()),
            size=size,
            local_rank=local_rank,
            local_size=local_size,
            timeout=timeout,
            debug=debug,
        )
        self.group = group
        self._store = store
        self._name = name
        self._progress = StoreBoard(store, f"hpdl/progress/{name}", self.rank, self.size)
        self._gloo = self.engine == "gloo"

    @property
    def engine(self) -> str:
        return str(dist.get_backend(self.group))

    def _board(self) -> ProgressBoard:
        return self._progress

    def _peer(self, rank: int) -> int:
        return self._global[rank]

    def _to_group_order(self, t: torch.Tensor) -> torch.Tensor:
        """Blocks of dim 0 in our rank order, rearranged into the group's order."""
        if not self._permuted:
            return t
        blocks = t.chunk(self.size) if t.shape[0] else [t] * self.size
        order = sorted(range(self.size), key=lambda i: self._slot[i])
        return torch.cat([blocks[i] for i in order])

    def _from_group_order(self, t: torch.Tensor) -> torch.Tensor:
        if not self._permuted or t.shape[0] == 0:
            return t
        blocks = t.chunk(self.size)
        return torch.cat([blocks[self._slot[i]] for i in range(self.size)])

    # Fast paths: the common blocking call on a plain contiguous tensor with debug, tracing and the
    # agreement check off (the default here) skips the general path's Work, closures and helpers;
    # it numbers and posts the call like `_begin`, and a handle still busy after one test gets the
    # same bounded wait. gloo itself checks sizes and dtypes.
    def allreduce(self, tensor: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        if type(tensor) is torch.Tensor and self._plain and not async_op and not self._every:
            reduce_op = _OPS.get(op)
            dtype = tensor.dtype
            if (
                reduce_op is not None and tensor.is_contiguous()
                and (op != "avg" or dtype.is_floating_point or dtype.is_complex)
                and not (dtype.is_complex and op in ("max", "min"))
            ):  # fmt: skip
                seq = self._seq = self._seq + 1
                self._progress.post(seq, "allreduce")
                handle = dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=True)
                if not handle.is_completed():
                    self._work("allreduce", seq, handle, None).wait()
                if op == "avg":
                    tensor.div_(self.size)
                return tensor
        return super().allreduce(tensor, op, async_op=async_op)

    def broadcast(self, tensor: Any, root: int = 0, *, async_op: bool = False) -> Any:
        if (
            type(tensor) is torch.Tensor and type(root) is int and 0 <= root < self.size and self._plain
            and not async_op and not self._every and tensor.is_contiguous()
        ):  # fmt: skip
            seq = self._seq = self._seq + 1
            self._progress.post(seq, "broadcast")
            handle = dist.broadcast(tensor, src=self._global[root], group=self.group, async_op=True)
            if not handle.is_completed():
                self._work("broadcast", seq, handle, None).wait()
            return tensor
        return super().broadcast(tensor, root, async_op=async_op)

    def _work(self, op: str, seq: int, handle: Any, finish: Any) -> Work:
        def block(limit: float) -> bool:
            try:
                handle.wait(timeout=_seconds(limit))
            except RuntimeError as exc:
                if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                    return False
                self._broken = True
                raise CommError(f"{op} #{seq} failed on rank {self.rank} ({self.engine}): {exc}") from exc
            return True

        # gloo's wait can time out and be called again; NCCL's aborts the communicator when it times out
        return Work(self, op, seq, handle.is_completed, finish, block, sliced=self._gloo)

    def _allreduce(self, t: torch.Tensor, op: str, seq: int) -> Work:
        handle = dist.all_reduce(t, op=_OPS[op], group=self.group, async_op=True)

        def finish() -> torch.Tensor:
            if op == "avg":
                t.div_(self.size)
            return t

        return self._work("allreduce", seq, handle, finish)

    def _allgather(self, t: torch.Tensor, sizes: list[int], seq: int, out: Optional[torch.Tensor] = None) -> Work:
        widest = max(sizes)
        tail = tuple(t.shape[1:])
        direct = len(set(sizes)) == 1 and not self._permuted
        send = t
        if t.shape[0] != widest:  # engines gather equal blocks: pad, then cut the padding away
            send = torch.zeros((widest, *tail), dtype=t.dtype, device=t.device)
            send[: t.shape[0]] = t
        gathered = (
            out
            if direct and out is not None
            else torch.empty((widest * self.size, *tail), dtype=t.dtype, device=t.device)
        )
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        handle = gather(gathered, send, group=self.group, async_op=True)

        def finish() -> torch.Tensor:
            if direct:
                return gathered
            blocks = [gathered[self._slot[r] * widest :][:n] for r, n in enumerate(sizes)]
            return torch.cat(blocks) if out is None else torch.cat(blocks, out=out)

        return self._work("allgather", seq, handle, finish)

    def _reduce_scatter(self, t: torch.Tensor, op: str, seq: int, out: Optional[torch.Tensor] = None) -> Work:
        result = (
            out
            if out is not None
            else torch.empty((t.shape[0] // self.size, *t.shape[1:]), dtype=t.dtype, device=t.device)
        )
        if op not in ("sum", "avg") and not t.is_cuda:
            return self._reduce_scatter_by_allreduce(t, op, seq, result)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        handle = scatter(result, self._to_group_order(t), op=_OPS[op], group=self.group, async_op=True)

        def finish() -> torch.Tensor:
            if op == "avg":
                result.div_(self.size)
            return result

        return self._work("reduce_scatter", seq, handle, finish)

    def _reduce_scatter_by_allreduce(self, t: torch.Tensor, op: str, seq: int, result: torch.Tensor) -> Work:
        """max, min and prod on CPU: gloo's reduce_scatter summed whatever the op said before some torch 2.x (torch
        2.4.1: MAX gave the sum, silently), and gloo does a reduce_scatter as allreduces anyway; this rank's
        block of one allreduce of a copy is the same answer on every version."""
        whole, block = t.clone(), t.shape[0] // self.size
        mine = whole.narrow(0, self.rank * block, block)
        handle = dist.all_reduce(whole, op=_OPS[op], group=self.group, async_op=True)
        return self._work("reduce_scatter", seq, handle, lambda: result.copy_(mine))

    def _broadcast(self, t: torch.Tensor, root: int, seq: int) -> Work:
        handle = dist.broadcast(t, src=self._peer(root), group=self.group, async_op=True)
        return self._work("broadcast", seq, handle, lambda: t)

    def _alltoall(self, t: torch.Tensor, seq: int, out: Optional[torch.Tensor] = None) -> Work:
        received = out if out is not None and not self._permuted else torch.empty_like(t)
        handle = dist.all_to_all_single(received, self._to_group_order(t), group=self.group, async_op=True)

        def finish() -> torch.Tensor:
            result = self._from_group_order(received)
            return result if out is None or result is out else out.copy_(result)

        return self._work("alltoall", seq, handle, finish)

    def _barrier(self, seq: int) -> Work:
        handle = dist.barrier(group=self.group, async_op=True)
        return self._work("barrier", seq, handle, lambda: None)

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> Work:
        handle = dist.isend(t, self._peer(dst), group=self.group, tag=tag)
        return self._work(f"send to {dst}", -1, handle, lambda: t)

    def _recv(self, t: torch.Tensor, src: Optional[int], tag: int) -> Work:
        if src is None:  # gloo's recv from any source: the handle knows the sender once it completed
            handle = dist.irecv(t, None, group=self.group, tag=tag)
            assert handle is not None  # None only for a rank outside the group, which no communicator has
            sender = handle._source_rank  # in the group's ranks, as hpdl's own

            def finish() -> torch.Tensor:
                work.source = sender()
                return t

            work = self._work("recv from any rank", -1, handle, finish)
            return work
        handle = dist.irecv(t, self._peer(src), group=self.group, tag=tag)
        work = self._work(f"recv from {src}", -1, handle, lambda: t)
        work.source = src
        return work

    def _split(self, color: Optional[int], key: int, seq: int) -> Optional[Communicator]:
        table = self.allgather_object((color, key, _hostname()))
        groups = {}
        if self.group is None:
            # A split of the whole world: every rank creates every group, in colour order,
            # so torch's group names agree on all ranks whatever each rank split before.
            for c in sorted({c for c, _, _ in table if c is not None}):
                ranks_c = [self._peer(r) for _, r in sorted((k, r) for r, (cc, k, _) in enumerate(table) if cc == c)]
                groups[c] = dist.new_group(ranks=ranks_c, timeout=_seconds(self.timeout))
        if color is None:
            return None
        members = sorted((k, r) for r, (c, k, _) in enumerate(table) if c == color)
        ranks = [self._peer(r) for _, r in members]
        # A split of a sub-group: only its members create the group (local synchronisation),
        # which needs nothing from ranks outside it. Known limit: torch names such groups by
        # each rank's count of groups, so members must have created equally many before.
        group = groups.get(color) or dist.new_group(
            ranks=ranks, timeout=_seconds(self.timeout), use_local_synchronization=True
        )
        same_node = [r for _, r in members if table[r][2] == table[self.rank][2]]
        return TorchCommunicator(
            group,
            self._store,
            local_rank=same_node.index(self.rank),
            local_size=len(same_node),
            timeout=self.timeout,
            debug=self.debug,
            members=ranks,
            name=f"{self._name}.{seq}.{color}",
        )

    def _close(self) -> None:
        if not self._finalizing and not self._broken:  # closed without the exit barrier (a sub-group)
            self._progress.post(self._seq + 1, "finalize")  # so a peer still in a collective on it is told
        if self.group is not None and not self._broken:
            dist.destroy_process_group(self.group)


def _hostname() -> str:
    import socket

    return socket.gethostname()
