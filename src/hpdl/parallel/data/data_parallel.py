"""`DataParallel`: every rank holds the whole model, computes on its shard of the batch, and averages gradients.

    model = hpdl.parallel.DataParallel(model, comm, bucket_mb=25)
    loss = loss_fn(model(x), y); loss.backward()   # grads are averaged when backward returns
    optimizer.step()
    with model.no_sync(): ...                      # accumulate locally, reduce at the next synced backward

Wrapping broadcasts rank 0's parameters and buffers, so every rank starts
from the same state. Gradients are reduced in buckets from hooks during
backward (`hpdl.parallel.data.buckets`). With `broadcast_buffers=True`, rank 0's
buffers (batch-norm running statistics) are broadcast before every forward
in training mode, as PyTorch DDP does.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Optional

import torch
from torch import nn

from hpdl.comm.base import Communicator
from hpdl.parallel.data.buckets import GradientReducer, allocate, describe
from hpdl.parallel.shared.gradient_sync import LocalAccumulation

__all__ = ["DataParallel", "broadcast_tensors"]


def broadcast_tensors(comm: Communicator, tensors: Iterable[torch.Tensor], root: int = 0) -> None:
    """Copy `root`'s values into `tensors` on every rank, with one broadcast per (dtype, device).

    Collective: every rank passes tensors of the same shapes in the same order.
    """
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    if comm.size == 1:
        return
    with torch.no_grad():
        for (dtype, device), group in groups.items():
            flat = allocate(comm, sum(t.numel() for t in group), dtype, device)
            if comm.rank == root:
                torch.cat([t.detach().reshape(-1) for t in group], out=flat)
            comm.broadcast(flat, root)
            if comm.rank != root:
                offset = 0
                for t in group:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()


class DataParallel(LocalAccumulation, nn.Module):
    """Wrap `module` so that `loss.backward()` leaves gradients averaged over the ranks of `comm`.

    Arguments:
        module: a plain `nn.Module`, already on its device.
        comm: the communicator (`hpdl.init()`); every rank wraps the same model.
        bucket_mb: megabytes per gradient bucket; smaller buckets start
            communicating earlier in backward, larger ones pay the per-call
            latency fewer times.
        compression: None, "fp16" or "bf16": gradients travel in that dtype
            and are averaged back in their own (the sum on the wire rounds).
        broadcast_buffers: broadcast rank 0's buffers before the first forward
            of each step in training mode (batch-norm statistics stay identical);
            later forwards of the same step (micro-batches, a pipeline's stage)
            leave them alone, as their backward still needs the values it saved.
        op: "avg" (the mean gradient, as one process on the whole batch) or "sum".

    Every rank must run the same number of synced backward passes; a
    parameter that gets no gradient on some rank in a step is handled
    (see `hpdl.parallel.data.buckets`). Forward and backward spans and one span
    per bucket allreduce go to `comm.tracer` when it is set.
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Communicator,
        *,
        bucket_mb: float = 25.0,
        compression: Optional[str] = None,
        broadcast_buffers: bool = True,
        op: str = "avg",
    ):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        self.module = module
        self.comm = comm
        self.broadcast_buffers = bool(broadcast_buffers)
        self._buffers_sent_at = -1  # the reducer's `reductions` when rank 0's buffers were last sent
        # Reverse registration order: roughly the order in which backward produces the gradients.
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        self.reducer = GradientReducer(params, comm, bucket_mb=bucket_mb, compression=compression, op=op)
        broadcast_tensors(comm, [*module.parameters(), *module.buffers()], root=0)

    @property
    def buckets(self) -> list[dict[str, Any]]:
        """The bucket layout: parameters, elements and bytes on the wire of each bucket, in launch order."""
        return describe(self.reducer.buckets)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self.training and self.comm.size > 1:
            # Once per step: an in-place copy into a buffer that an earlier micro-batch's graph saved (batch
            # norm's running statistics) would fail that micro-batch's backward, on the receiving ranks only.
            if self._buffers_sent_at != self.reducer.reductions:
                self._buffers_sent_at = self.reducer.reductions
                buffers = list(self.module.buffers())
                if buffers:
                    broadcast_tensors(self.comm, buffers, root=0)
        tracer = self.comm.tracer
        if tracer is None:
            return self.module(*args, **kwargs)
        with tracer.span("forward"):
            out = self.module(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.requires_grad and self.reducer.enabled:
            out.register_hook(self._mark_backward_start)
        return out

    def _mark_backward_start(self, grad: torch.Tensor) -> None:
        self.reducer.backward_started = time.perf_counter()

    def __repr__(self) -> str:
        return f"DataParallel(ranks={self.comm.size}, buckets={len(self.reducer.buckets)}, module={self.module!r})"
