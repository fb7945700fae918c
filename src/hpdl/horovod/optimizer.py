"""Horovod's `DistributedOptimizer`, on hpdl's gradient buckets (`hpdl.parallel.data.buckets.GradientReducer`)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from hpdl.horovod.ops import Adasum, Compression, check_op, compression_name, world
from hpdl.parallel.data.buckets import GradientReducer
from hpdl.parallel.shared.optimizer_proxy import InnerOptimizerState

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer(InnerOptimizerState, torch.optim.Optimizer):
    """Wraps an optimizer: gradients are averaged during backward; `step()` waits for them, then steps.

    It shares `param_groups` and `state` with the wrapped optimizer (so LR
    schedulers and `state_dict` work on either), but it is not an instance
    of the wrapped optimizer's class (Horovod builds such a subclass at run
    time; hpdl composes instead).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Optional[Iterable[tuple[str, torch.nn.Parameter]]],
        compression: Any,
        backward_passes_per_step: int,
        op: Any,
        gradient_predivide_factor: float,
        bucket_mb: float,
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        reduce_op = check_op(op)
        if reduce_op not in ("avg", "sum"):
            raise ValueError(f"DistributedOptimizer: op={op!r}; gradients are reduced with hvd.Average or hvd.Sum")
        if gradient_predivide_factor <= 0:
            raise ValueError(f"gradient_predivide_factor={gradient_predivide_factor} must be positive")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            names = [name for name, _ in named]
            duplicates = sorted({n for n in names if names.count(n) > 1})
            if duplicates:
                raise ValueError(f"DistributedOptimizer: named_parameters has duplicate names: {duplicates}")
            given = {id(p) for _, p in named}
            unnamed = sum(1 for p in params if id(p) not in given)
            if unnamed:
                raise ValueError(
                    f"DistributedOptimizer: {unnamed} of the optimizer's {len(params)} parameters are not in "
                    "named_parameters; pass model.named_parameters() of the model the optimizer trains"
                )
        # Optimizer.__init__ sets up hooks and profiling names; its param_groups and state go to a scratch
        # slot (see the properties below) and from then on every access reaches the wrapped optimizer's.
        super().__init__([{"params": [torch.nn.Parameter(torch.empty(0))]}], dict(optimizer.defaults))
        self.__dict__.pop("_scratch", None)
        self.optimizer = optimizer
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.op = reduce_op
        self._synchronize_in_step = True
        self.comm = world()
        self._reducer = GradientReducer(
            params[::-1],
            self.comm,
            bucket_mb=bucket_mb,
            compression=compression_name(compression),
            op=reduce_op,
            sync_every=self.backward_passes_per_step,
        )

    def synchronize(self) -> None:
        """Make sure every gradient is reduced (reduce now those accumulated without a reduction)."""
        if self._reducer.unsynced:
            self._reducer.sync_now()

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """`step()` inside does not synchronize (after an explicit `synchronize()` and, say, gradient clipping)."""
        self._synchronize_in_step = False
        try:
            yield
        finally:
            self._synchronize_in_step = True

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        if self._synchronize_in_step:
            self.synchronize()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "optimizer"):
            raise NotImplementedError("DistributedOptimizer: add parameter groups before wrapping the optimizer")
        super().add_param_group(param_group)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"


def DistributedOptimizer(  # noqa: N802 - Horovod's name
    optimizer: torch.optim.Optimizer,
    named_parameters: Optional[Iterable[tuple[str, torch.nn.Parameter]]] = None,
    compression: Any = Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = "avg",
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
    *,
    bucket_mb: float = 25.0,
) -> torch.optim.Optimizer:
    """Horovod's DistributedOptimizer: average gradients across ranks during backward, step when they are ready.

    `gradient_predivide_factor` changes only where Horovod divides (before or
    after the sum); hpdl always sums and then divides, which gives the same
    average. `num_groups`/`groups` (Horovod's manual fusion groups) are
    replaced by `bucket_mb`; `process_set` is not supported.
    """
    if op is Adasum or check_op(op) == "adasum":
        check_op(Adasum)  # raises the explanation
    if process_set is not None:
        raise NotImplementedError("hpdl.horovod: process sets are not supported; use comm.split() in hpdl")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} must be a positive int")
    return _DistributedOptimizer(
        optimizer, named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor, bucket_mb
    )
