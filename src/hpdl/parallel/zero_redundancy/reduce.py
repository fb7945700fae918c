"""Reduce-scatter of gradients during backward (ZeRO stages 2 and 3): each rank keeps only its shard.

A `post_accumulate_grad` hook on every parameter copies the gradient into
its unit's staging buffer (the unit's padded flat layout) and drops
`param.grad`, so the full gradient of a parameter lives only until its unit
is complete. A complete unit starts `reduce_scatter(op="avg")` at once,
asynchronously, while backward goes on (the overlap of DeepSpeed's ZeRO-2
buckets and FSDP's reduce-scatter); the result is written, or added, into
the unit's gradient shard. Units start strictly in one order on every rank,
so collectives match whatever order the hooks fire in; each hook also polls
the reductions in flight (MPI moves data only inside calls).

When backward ends (the autograd engine's final callback), units that never
completed (parameters with no gradient this pass) are completed with the
gradients accumulated in earlier `no_sync` passes, or zeros, and reduced
too: every rank launches every unit, so nothing hangs. Each rank's block
carries one usage flag per parameter of the unit (as DataParallel's buckets
do): a parameter that no rank had a gradient for keeps none, as in one
process. Backward passes with
`enabled = False` (`no_sync`) only accumulate `param.grad` locally; they
still report each unit whose gradients are all in (`on_unit_done(u,
False)`), so that stage 3 frees its parameters after each micro-batch's
backward, not at the end of the pass.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from hpdl.comm.base import Communicator
from hpdl.comm.work import Work
from hpdl.parallel.data.buckets import queue_end_of_backward
from hpdl.parallel.zero_redundancy.units import UnitBuffers

__all__: list[str] = []


class ShardReducer:
    """Reduce-scatters the gradients of `units` (launched in `order`) into each unit's gradient shard."""

    def __init__(
        self,
        units: Sequence[UnitBuffers],
        comm: Communicator,
        order: Sequence[int],
        *,
        on_unit_done: Optional[Callable[[int, bool], None]] = None,
        on_backward_end: Optional[Callable[[bool], None]] = None,
        on_backward_start: Optional[Callable[[], None]] = None,
    ):
        self.units = list(units)
        self.comm = comm
        self.order = list(order)
        self.enabled = True
        self.unsynced = False
        self.on_unit_done = on_unit_done
        """Called with (unit, reducing) when a unit's gradients of this pass are all in (stage 3 frees it)."""
        self.on_backward_end = on_backward_end
        self.on_backward_start = on_backward_start
        self.in_backward = False
        self._syncing = False
        self._next = 0
        self._polled = 0
        self._staging: list[Optional[torch.Tensor]] = [None] * len(self.units)
        self._ready: list[list[bool]] = [[False] * len(u.params) for u in self.units]
        self._remaining = [len(u.params) for u in self.units]
        self._work: list[Optional[Work]] = [None] * len(self.units)
        self._out: list[Optional[torch.Tensor]] = [None] * len(self.units)
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, u, slot))
            for u, buffers in enumerate(self.units)
            for slot, p in enumerate(buffers.params)
        ]

    # ------------------------------------------------------------------ public
    def begin(self) -> None:
        """Mark the start of a backward pass (idempotent); queues the end-of-backward work."""
        if self.in_backward:
            return
        self.in_backward = True
        self._syncing = self.enabled
        self._remaining = [len(u.params) for u in self.units]
        self._ready = [[False] * len(u.params) for u in self.units]
        if self._syncing:
            self._next = self._polled = 0
        else:
            self.unsynced = True
        if self.on_backward_start is not None:
            self.on_backward_start()
        queue_end_of_backward(self._end_backward)

    def sync_now(self) -> None:
        """Reduce the locally accumulated gradients now (collective), outside backward."""
        if self.in_backward:
            raise RuntimeError("sync_gradients: a backward pass is running; gradients are reduced when it ends")
        self._next = self._polled = 0
        self._remaining = [len(u.params) for u in self.units]
        self._ready = [[False] * len(u.params) for u in self.units]
        self._reduce_rest()
        self._wait_all()
        self.unsynced = False

    def poll(self) -> None:
        """Retire the reduce-scatters that have finished (their staging rows freed), without waiting."""
        if self._syncing:
            self._poll()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ hooks
    def _on_grad(self, u: int, slot: int, param: nn.Parameter) -> None:
        self.begin()
        if not self._syncing:  # no_sync: the gradient stays in param.grad
            if not self._ready[u][slot]:
                self._ready[u][slot] = True
                self._remaining[u] -= 1
                if self._remaining[u] == 0 and self.on_unit_done is not None:
                    self.on_unit_done(u, False)
            return
        self._stage(u, slot, param)
        self._ready[u][slot] = True
        self._remaining[u] -= 1
        if self._remaining[u] == 0:
            if self.on_unit_done is not None:
                self.on_unit_done(u, True)
            self._launch_ready()
        self._poll()

    def _end_backward(self) -> None:
        self.in_backward = False
        syncing = self._syncing
        if syncing:
            self._syncing = False
            self._reduce_rest()
            self._wait_all()
            self.unsynced = False
        if self.on_backward_end is not None:
            self.on_backward_end(syncing)

    # ------------------------------------------------------------------ steps
    def _staging_for(self, u: int) -> torch.Tensor:
        """Rows of (S gradient elements, one usage flag per parameter), one row per rank: the reduce-scatter
        gives rank r its gradient shard and, summed over ranks, how many ranks had each parameter's gradient."""
        staging = self._staging[u]
        if staging is None:
            unit, flat = self.units[u].unit, self.units[u].flat
            staging = torch.zeros(unit.ranks, unit.shard + len(unit.slots), dtype=flat.dtype, device=flat.device)
            self._staging[u] = staging
        return staging

    def _stage(self, u: int, slot: int, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        if grad.is_sparse:
            raise TypeError("ZeRO cannot reduce sparse gradients (nn.Embedding(sparse=True)): use sparse=False")
        unit = self.units[u].unit
        rows = self._staging_for(u)
        s, src, width = unit.slots[slot], grad.reshape(-1), unit.shard
        pos, end = s.offset, s.offset + s.numel
        while pos < end:  # the parameter's elements, cut at rank boundaries
            row, col = divmod(pos, width)
            take = min(end - pos, width - col)
            rows[row, col : col + take].copy_(src[pos - s.offset : pos - s.offset + take])
            pos += take
        rows[:, width + slot] = 1
        param.grad = None

    def _launch_ready(self) -> None:
        while self._next < len(self.order) and self._remaining[self.order[self._next]] == 0:
            self._launch(self.order[self._next])
            self._next += 1

    def _launch(self, u: int) -> None:
        buffers = self.units[u]
        staging = self._staging_for(u).reshape(-1)
        buffers.ensure_grad()
        grad = buffers.grad_flat
        assert grad is not None
        direct = buffers.grad_fresh and grad.dtype == staging.dtype
        out = grad if direct else torch.empty(grad.numel(), dtype=staging.dtype, device=staging.device)
        self._out[u] = out
        self._work[u] = self.comm.reduce_scatter(staging, "avg", out=out, async_op=True)

    def _poll(self) -> None:
        """Retire the reductions that finished, in launch order: their staging rows are freed at once, so a
        backward pass holds the staging of the units in flight only, not a full-size gradient by its end."""
        while self._polled < self._next:
            u = self.order[self._polled]
            work = self._work[u]
            if work is not None:
                if not work.is_completed():
                    return
                self._retire(u)
            self._polled += 1

    def _reduce_rest(self) -> None:
        for u in self.order[self._next :]:
            for slot, p in enumerate(self.units[u].params):
                if not self._ready[u][slot] and p.grad is not None:  # accumulated in no_sync passes
                    self._stage(u, slot, p)
            self._remaining[u] = 0
            if self.on_unit_done is not None:
                self.on_unit_done(u, True)
            self._launch(u)
        self._next = len(self.order)

    def _wait_all(self) -> None:
        for u in self.order:
            if self._work[u] is not None:
                self._retire(u)

    def _retire(self, u: int) -> None:
        """Wait for unit `u`'s reduce-scatter, write (or add) its result into the gradient shard, free its rows."""
        work = self._work[u]
        if work is not None:
            work.wait()
            buffers = self.units[u]
            out = self._out[u]
            assert buffers.grad_flat is not None and out is not None
            if out is not buffers.grad_flat:
                if buffers.grad_fresh:
                    buffers.grad_flat.copy_(out)
                else:
                    buffers.grad_flat.add_(out)
            buffers.grad_fresh = False
            self._work[u] = None
            self._out[u] = None
            self._staging[u] = None
