"""Gradient buckets: average gradients across ranks while backward is still running.

`GradientReducer` is the engine under `DataParallel` and under the Horovod
shim's `DistributedOptimizer`. It packs the gradients of a list of
parameters into flat buffers (buckets) of about `bucket_mb` megabytes, in
reverse registration order (backward produces the last layers' gradients
first), and keeps each parameter's `.grad` as a view into its bucket, so
that a gradient is copied at most once per step (none when the optimizer
zeroes gradients in place). A `post_accumulate_grad` hook on every
parameter counts the gradients that arrived; a full bucket starts its
allreduce at once (asynchronously), so communication of the last layers
overlaps the backward of the first ones (PyTorch DDP's reducer, Horovod's
tensor fusion; Li et al., "PyTorch Distributed", VLDB 2020).

Buckets start strictly in order (bucket i only after buckets < i), so every
rank issues the same collectives in the same order whatever order its hooks
fire in. When backward returns, the buckets that never filled (parameters
that got no gradient in this step) are completed with the local gradient or
zeros and reduced too: every rank always launches every bucket, so a
parameter used on one rank and not on another never hangs the job.

Each bucket carries one extra element per parameter, 1 where this rank had
a gradient for it and 0 where not, reduced along with the gradients. After
the reduction a parameter that no rank had a gradient for keeps `.grad =
None`, exactly as in one process on the whole batch, so optimizers with
momentum or weight decay do not move it.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from hpdl.comm.base import Communicator
from hpdl.comm.work import Work

__all__: list[str] = []

COMPRESSIONS: dict[Optional[str], Optional[torch.dtype]] = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}
"""Wire dtypes: gradients are cast to it for the allreduce and averaged back in their own dtype."""
REDUCE_OPS = ("avg", "sum")


def allocate(comm: Communicator, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every flat bucket buffer comes from here: from `comm.shared_buffer(numel, dtype)` when the
    communicator offers one (a CPU buffer the engine can reduce without copies), else `torch.empty`."""
    shared = getattr(comm, "shared_buffer", None)
    if shared is not None and device.type == "cpu":
        buffer = shared(numel, dtype)
        if not isinstance(buffer, torch.Tensor) or buffer.numel() != numel or buffer.dtype != dtype:
            raise TypeError(f"{type(comm).__name__}.shared_buffer({numel}, {dtype}) did not return such a tensor")
        return buffer
    return torch.empty(numel, dtype=dtype, device=device)


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run `callback` once the backward pass now running has finished (every `.grad` accumulated).

    torch has no public hook for "this backward pass is over":
    `torch.autograd.graph.register_multi_grad_hook` fires when the last
    gradient is *computed*, before it is accumulated into `.grad` (and would
    need re-registering for the set of parameters each graph reaches). The
    autograd engine's final-callback queue is what PyTorch's own DDP and
    FSDP use for this; it is the one private call in hpdl.parallel, kept here.
    """
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]


@dataclass
class Bucket:
    """Parameters of one dtype and device whose gradients travel together."""

    index: int
    params: list[torch.nn.Parameter]
    flat: torch.Tensor
    """numel(params) gradient elements, then one usage flag per parameter."""
    views: list[torch.Tensor]
    flags: torch.Tensor
    wire: Optional[torch.Tensor]
    numel: int
    remaining: int = 0
    ready: list[bool] = field(default_factory=list)
    work: Optional[Work] = None
    launched: float = 0.0
    finished: float = 0.0

    @property
    def nbytes(self) -> int:
        wire = self.wire if self.wire is not None else self.flat
        return wire.numel() * wire.element_size()


def plan_buckets(
    params: Sequence[torch.nn.Parameter], comm: Communicator, bucket_bytes: int, wire: Optional[torch.dtype]
) -> list[Bucket]:
    """Group `params` (already in launch order) into buckets of at most `bucket_bytes` per (dtype, device)."""
    groups: list[list[torch.nn.Parameter]] = []
    filled = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        last = groups[-1][-1] if groups else None
        same_kind = last is not None and last.dtype == p.dtype and last.device == p.device
        if not same_kind or filled + nbytes > bucket_bytes:
            groups.append([])
            filled = 0
        groups[-1].append(p)
        filled += nbytes
    buckets = []
    for index, group in enumerate(groups):
        numel = sum(p.numel() for p in group)
        flat = allocate(comm, numel + len(group), group[0].dtype, group[0].device)
        flat.zero_()
        views, offset = [], 0
        for p in group:
            views.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        wire_buffer = None
        if wire is not None and wire != group[0].dtype:
            wire_buffer = allocate(comm, flat.numel(), wire, group[0].device)
        buckets.append(Bucket(index, group, flat, views, flat[numel:], wire_buffer, numel))
    return buckets


class GradientReducer:
    """Averages (or sums) the gradients of `params` across `comm` from hooks during backward.

    `sync_every` backward passes reduce (the others only accumulate locally,
    Horovod's `backward_passes_per_step`); `enabled = False` skips reduction
    (DataParallel's `no_sync`). Call `remove()` to take the hooks off.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        comm: Communicator,
        *,
        bucket_mb: float = 25.0,
        compression: Optional[str] = None,
        op: str = "avg",
        sync_every: int = 1,
    ):
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb={bucket_mb!r} must be a positive number of megabytes")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression={compression!r}: choose None, 'fp16' or 'bf16'")
        if op not in REDUCE_OPS:
            raise ValueError(f"op={op!r}: gradients can be reduced with {' or '.join(REDUCE_OPS)}")
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r} must be a positive int (backward passes per reduction)")
        unique = list({id(p): p for p in params if p.requires_grad}.values())
        for p in unique:
            if not (p.dtype.is_floating_point or p.dtype.is_complex):
                raise TypeError(f"a parameter of dtype {p.dtype} cannot have gradients to average")
        self.comm = comm
        self.op = op
        self.compression = compression
        self.sync_every = sync_every
        self.enabled = True
        self.bucket_mb = float(bucket_mb)
        self.buckets = plan_buckets(unique, comm, int(bucket_mb * 1024 * 1024), COMPRESSIONS[compression])
        self._in_backward = False
        self._syncing = False
        self._passes = 0
        self._unsynced = False
        self._next = 0  # the next bucket to launch
        self._polled = 0  # the first launched bucket not yet seen complete
        self.backward_started = 0.0
        self.reductions = 0
        """How many times the gradients were reduced (synced backward passes and `sync_now`): a step counter."""
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, bucket.index, slot))
            for bucket in self.buckets
            for slot, p in enumerate(bucket.params)
        ]

    # ------------------------------------------------------------------ public
    @property
    def unsynced(self) -> bool:
        """True when local gradients accumulated since the last reduction (passes that did not reduce)."""
        return self._unsynced

    def sync_now(self) -> None:
        """Reduce every parameter's current `.grad` now (outside backward; collective: every rank must call it)."""
        if self._in_backward:
            raise RuntimeError("sync_now: a backward pass is running; gradients are reduced when it ends")
        self._reset()
        self._reduce_rest()
        self._wait_all()
        self._unsynced = False
        self.reductions += 1

    def remove(self) -> None:
        """Unregister the gradient hooks (the gradients stay views of the buckets until reset)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ hooks
    def _on_grad(self, index: int, slot: int, param: torch.nn.Parameter) -> None:
        if not self._in_backward:
            self._begin_backward()
        if not self._syncing:
            return
        bucket = self.buckets[index]
        self._adopt(bucket, slot, param)
        bucket.ready[slot] = True
        bucket.remaining -= 1
        if bucket.remaining == 0 and index == self._next:
            self._launch_ready()
        else:
            self._poll()

    def _begin_backward(self) -> None:
        self._in_backward = True
        self._passes += 1
        self._syncing = self.enabled and self._passes % self.sync_every == 0
        if self._syncing:
            self._reset()
        else:
            self._unsynced = True
        queue_end_of_backward(self._end_backward)

    def _end_backward(self) -> None:
        self._in_backward = False
        if not self._syncing:
            self.backward_started = 0.0
            return
        self._syncing = False
        self._reduce_rest()
        self._wait_all()
        self._unsynced = False
        self._passes = 0
        self.reductions += 1

    # ------------------------------------------------------------------ steps
    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.remaining = len(bucket.params)
            bucket.ready = [False] * len(bucket.params)
            bucket.work = None
        self._next = 0
        self._polled = 0
        if not self.backward_started:
            self.backward_started = time.perf_counter()

    @staticmethod
    def _adopt(bucket: Bucket, slot: int, param: torch.nn.Parameter) -> None:
        """Make `param.grad` the bucket's view (copying a gradient autograd allocated on its own)."""
        grad = param.grad
        view = bucket.views[slot]
        if grad is None or grad is view:
            return
        if grad.is_sparse:
            raise TypeError(
                "DataParallel cannot average sparse gradients (nn.Embedding(sparse=True)): use sparse=False"
            )
        view.copy_(grad)
        param.grad = view

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self.buckets[self._next].remaining == 0:
            bucket = self.buckets[self._next]
            bucket.flags.fill_(1)
            self._launch(bucket)
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = time.perf_counter()
        bucket.finished = 0.0
        if bucket.wire is None:
            bucket.work = self.comm.allreduce(bucket.flat, self.op, async_op=True)
        else:  # cast for the wire, sum there, divide back in the gradients' own precision (_finish)
            bucket.wire.copy_(bucket.flat)
            bucket.work = self.comm.allreduce(bucket.wire, "sum", async_op=True)

    def _poll(self) -> None:
        """Let the engine move launched buckets (MPI progresses a transfer only inside a call)."""
        while self._polled < self._next:
            bucket = self.buckets[self._polled]
            assert bucket.work is not None
            if not bucket.work.is_completed():
                return
            bucket.finished = time.perf_counter()
            self._polled += 1

    def _reduce_rest(self) -> None:
        """Complete the buckets that never filled (parameters without a gradient this pass) and launch them."""
        for bucket in self.buckets[self._next :]:
            flags = []
            for slot, p in enumerate(bucket.params):
                if bucket.ready[slot]:
                    flags.append(1.0)
                elif p.grad is not None:  # accumulated in earlier passes (no_sync) or left from the last step
                    self._adopt(bucket, slot, p)
                    flags.append(1.0)
                else:
                    bucket.views[slot].zero_()
                    flags.append(0.0)
            bucket.flags.copy_(torch.tensor(flags, dtype=bucket.flags.dtype))
            self._launch(bucket)
        self._next = len(self.buckets)

    def _wait_all(self) -> None:
        tracer = self.comm.tracer
        for bucket in self.buckets:
            assert bucket.work is not None
            bucket.work.wait()
            if not bucket.finished:
                bucket.finished = time.perf_counter()
            self._finish(bucket)
            bucket.work = None
            if tracer is not None:
                tracer.complete(
                    f"allreduce bucket {bucket.index}",
                    bucket.launched,
                    bucket.finished,
                    category="comm",
                    bytes=bucket.nbytes,
                    params=len(bucket.params),
                )
        if tracer is not None and self.backward_started:
            tracer.complete("backward", self.backward_started, time.perf_counter(), category="compute")
        self.backward_started = 0.0

    def _finish(self, bucket: Bucket) -> None:
        if bucket.wire is not None:
            bucket.flat.copy_(bucket.wire)
            if self.op == "avg":
                bucket.flat.div_(self.comm.size)
        if bool((bucket.flags > 0).all()):  # the common case: every parameter had a gradient somewhere
            for p, view in zip(bucket.params, bucket.views):
                if p.grad is not view:
                    p.grad = view
            return
        for p, view, used in zip(bucket.params, bucket.views, bucket.flags.tolist()):
            p.grad = view if used > 0 else None


def describe(buckets: Sequence[Bucket]) -> list[dict[str, Any]]:
    """One line per bucket (for logs and benchmark headers): parameters, elements, bytes on the wire."""
    return [
        {
            "bucket": b.index,
            "params": len(b.params),
            "numel": b.numel,
            "wire_bytes": b.nbytes,
            "dtype": str(b.flat.dtype),
        }
        for b in buckets
    ]
