"""Horovod's `DistributedOptimizer`: gradients are reduced across the process set during backward.

As in Horovod, the returned object is an instance of a subclass of the
wrapped optimizer's own class (so `isinstance(opt, torch.optim.SGD)` holds),
built on the wrapped optimizer's `param_groups`. Dense gradients travel in
hpdl's gradient buckets (`GradientReducer`, the engine of `DataParallel`):
a bucket starts its allreduce as soon as its gradients are ready, so
communication overlaps backward. Sparse gradients (`nn.Embedding(sparse=True)`)
are gathered as indices and values, or, with `sparse_as_dense=True`, reduced
densely and returned sparse. A user's own `Compressor` sends every gradient
through the named `grouped_allreduce` instead (no overlap, any compression).
`op=hvd.Adasum` is Horovod's delta optimizer: each rank steps locally and the
parameter deltas are combined with Adasum.
"""

from __future__ import annotations

import warnings
import zlib
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from hpdl.horovod import basics, functions, ops
from hpdl.horovod.basics import Adasum, Average, Sum
from hpdl.horovod.compression import Compression, wire_name
from hpdl.horovod.process_sets import ProcessSet, global_process_set, optimizer_comm, resolve
from hpdl.parallel.data.buckets import Bucket, GradientReducer

__all__ = ["DistributedOptimizer"]


class _HorovodReducer(GradientReducer):
    """Gradient buckets that also carry sparse gradients (gathered after the buckets, or densified)."""

    def __init__(self, *args: Any, sparse_as_dense: bool, sparse_op: int, process_set: ProcessSet, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.sparse_as_dense = sparse_as_dense
        self.sparse_op = sparse_op
        self.process_set = process_set
        self._sparse: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._densified: list[torch.nn.Parameter] = []
        self.names: dict[Any, str] = {}
        self.on_reduced: Callable[[], None] = lambda: None

    def _adopt(self, bucket: Bucket, slot: int, param: torch.nn.Parameter) -> None:  # type: ignore[override]
        grad = param.grad
        if grad is not None and grad.is_sparse:
            view = bucket.views[slot]
            if self.sparse_as_dense:
                view.copy_(grad.to_dense())
                self._densified.append(param)
            else:
                view.zero_()
                self._sparse[param] = grad
            param.grad = view
            return
        GradientReducer._adopt(bucket, slot, param)

    def _wait_all(self) -> None:
        super()._wait_all()
        for p in self._densified:
            if p.grad is not None:
                p.grad = p.grad.to_sparse()
        self._densified = []
        if self._sparse:
            handles = [
                (p, ops.sparse_allreduce_async(g, self.names.get(p, "sparse"), self.sparse_op, self.process_set))
                for p, g in self._sparse.items()
            ]
            self._sparse = {}
            for p, handle in handles:
                p.grad = handle()
        self.on_reduced()


class _DistributedOptimizer:
    """The methods Horovod adds to the wrapped optimizer's class (mixed in before it)."""

    def __init__(
        self,
        params: Any,
        named_parameters: Optional[list[tuple[str, torch.Tensor]]],
        compression: Any,
        backward_passes_per_step: int,
        op: int,
        gradient_predivide_factor: float,
        groups: Any,
        sparse_as_dense: bool,
        process_set: ProcessSet,
        bucket_mb: float,
    ):
        super().__init__(params)  # type: ignore[call-arg]
        self._compression = compression
        self._wire = wire_name(compression)
        all_params = [p for group in self.param_groups for p in group["params"]]  # type: ignore[attr-defined]
        if named_parameters is None:
            named_parameters = [
                (f"allreduce.noname.{i}.{j}", v)
                for i, group in enumerate(self.param_groups)  # type: ignore[attr-defined]
                for j, v in enumerate(group["params"])
            ]
        named_ids = {id(v) for _, v in named_parameters}
        unnamed = [p for p in all_params if id(p) not in named_ids]
        if unnamed:
            raise ValueError(
                "named_parameters was specified, but one or more model parameters were not named "
                f"({len(unnamed)} of {len(all_params)}); pass model.named_parameters() of the model it trains"
            )
        self._parameter_names = {v: k for k, v in sorted(named_parameters, key=lambda kv: kv[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._groups = groups
        self._synchronized = False
        self._should_synchronize = True
        self._awaiting_step = False
        self._reducer: Optional[_HorovodReducer] = None
        self._active = bool(process_set.included()) and (process_set.size() or 1) > 1
        if not self._active:
            return
        resolve(process_set, "DistributedOptimizer")
        self._check_agreement(all_params)
        if op == Adasum or self._wire == "":
            return  # reduced in step() / synchronize() through the named operations
        trainable = [p for p in all_params if p.requires_grad]
        self._reducer = _HorovodReducer(
            trainable[::-1],
            optimizer_comm(process_set),
            bucket_mb=bucket_mb,
            compression=self._wire,
            op="avg" if op == Average else "sum",
            sync_every=backward_passes_per_step,
            sparse_as_dense=sparse_as_dense,
            sparse_op=op,
            process_set=process_set,
        )
        self._reducer.names = dict(self._parameter_names)
        self._reducer.on_reduced = self._mark_reduced
        self._guard = [p.register_hook(self._guard_hook) for p in trainable]

    def _check_agreement(self, params: list[torch.Tensor]) -> None:
        """Every member wraps the same parameters (names, shapes, dtypes): one small named allgather."""
        listing = ";".join(f"{self._parameter_names.get(p)}:{tuple(p.shape)}:{p.dtype}" for p in params)
        digest = zlib.crc32(listing.encode())
        settings = (digest, len(params), self.op, self.backward_passes_per_step, str(self._wire))
        everyone = functions.allgather_object(settings, name="DistributedOptimizer.setup", process_set=self.process_set)
        if any(s != settings for s in everyone):
            raise ValueError(
                "DistributedOptimizer: ranks wrap different parameters or settings (by rank: "
                f"{everyone}; digest of names/shapes/dtypes, count, op, backward_passes_per_step, compression); "
                "every rank must wrap the same model in the same way"
            )

    def _guard_hook(self, grad: torch.Tensor) -> torch.Tensor:
        if self._awaiting_step and self._reducer is not None and self._reducer._passes == 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before call to step(). "
                "Increase backward_passes_per_step to accumulate gradients locally."
            )
        return grad

    def _mark_reduced(self) -> None:
        self._awaiting_step = True

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        if self._reducer is not None:
            self._reducer.sync_every = passes
            self._reducer._passes = 0

    def synchronize(self) -> None:
        """Make sure every gradient is reduced (reduce now those of passes that did not reduce yet)."""
        if not self._active:
            self._synchronized = True
            return
        if self._reducer is not None:
            if self._reducer.unsynced:
                self._reducer.sync_now()
                self._reducer._passes = 0
        elif self.op != Adasum:
            self._named_reduce()
        self._synchronized = True

    def _named_reduce(self) -> None:
        """Reduce every gradient with a named grouped allreduce (the path of a user's own Compressor)."""
        params = [p for p in self._parameter_names if p.requires_grad]
        dense, sparse = [], []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if p.grad.is_sparse and not self.sparse_as_dense:
                sparse.append(p)
            else:
                dense.append(p)
        pre, post = (1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor)
        if self.op != Average:
            pre = post = 1.0
        grads = {p: p.grad for p in params if p.grad is not None}
        pairs = [self._compression.compress(grads[p].to_dense() if grads[p].is_sparse else grads[p]) for p in dense]
        handle = ops.grouped_allreduce_async_(
            [c for c, _ in pairs], name=f"DistributedOptimizer.{self._parameter_names[dense[0]]}" if dense else None,
            op=self.op, prescale_factor=pre, postscale_factor=post, process_set=self.process_set,
        ) if dense else None  # fmt: skip
        sparse_handles = [
            ops.sparse_allreduce_async(grads[p], self._parameter_names[p], self.op, self.process_set) for p in sparse
        ]
        if handle is not None:
            outs = ops.synchronize(handle)
            for p, out, (_, ctx) in zip(dense, outs, pairs):
                reduced = self._compression.decompress(out, ctx)
                p.grad = reduced.to_sparse() if grads[p].is_sparse else reduced.view_as(p)
        for p, h in zip(sparse, sparse_handles):
            p.grad = h()

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """`step()` inside does not synchronize (after an explicit `synchronize()` and, say, clipping)."""
        if self.op == Adasum and self._active:
            raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        if self.op == Adasum and self._active:
            return self._adasum_step(closure)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        self._awaiting_step = False
        return super().step(closure)  # type: ignore[misc]

    def _adasum_step(self, closure: Optional[Callable[[], float]]) -> Optional[float]:
        """Horovod's delta optimizer: step locally, combine the parameter deltas with Adasum."""
        loss = closure() if closure is not None else None
        params = [p for p in self._parameter_names if p.requires_grad]
        starts = [p.detach().clone() for p in params]
        super().step()  # type: ignore[misc]
        deltas = [p.detach() - s for p, s in zip(params, starts)]
        if deltas:
            combined = ops.grouped_allreduce(
                deltas, name="DistributedOptimizer.adasum", op=Adasum, process_set=self.process_set
            )
            with torch.no_grad():
                for p, s, d in zip(params, starts, combined):
                    p.copy_(s + d)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        return super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._synchronized = False
        self._should_synchronize = True
        self._awaiting_step = False
        super().load_state_dict(state_dict)  # type: ignore[misc]


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Optional[Iterable[tuple[str, torch.nn.Parameter]]] = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
    *,
    bucket_mb: float = 25.0,
) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that gradients are averaged (op=Sum: summed; op=Adasum: delta-combined) across the
    process set before `step()` applies them.

    `groups` / `num_groups` (Horovod's manual fusion groups) are checked and then served by the buckets
    (`bucket_mb`, hpdl's fusion size), which fuse at least as much; results are the same.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    op = basics.check_op(op)
    named = None
    if named_parameters is not None:
        named = list(named_parameters)
        if any(not isinstance(p, tuple) for p in named):
            raise ValueError(
                "named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                "model.named_parameters()."
            )
        names = [k for k, _ in named]
        dups = sorted({k for k in names if names.count(k) > 1})
        if dups:
            raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} must be positive")
    if num_groups != 0:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
            DeprecationWarning,
            stacklevel=2,
        )
        if groups is None:
            groups = num_groups
    if groups is not None:
        _check_groups(groups)
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op not in (Average, Sum, Adasum):
        raise ValueError(
            f"DistributedOptimizer: op={basics.op_name(op)}; gradients are reduced with Average, Sum or Adasum"
        )
    if op == Adasum and process_set is not global_process_set:
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    wire_name(compression)
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    return cls(  # type: ignore[no-any-return]
        optimizer.param_groups, named, compression, backward_passes_per_step, op,
        gradient_predivide_factor, groups, sparse_as_dense, process_set, bucket_mb,
    )  # fmt: skip


def _check_groups(groups: Any) -> None:
    if isinstance(groups, bool) or not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if isinstance(groups, list):
        seen: set[int] = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
