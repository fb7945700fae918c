"""`DistributedOptimizer`: any Keras 3 optimizer, with gradients averaged across ranks before it applies them.

Keras 2's hooks that Horovod used (`get_gradients`, `_compute_gradients`,
`_aggregate_gradients`) are gone in Keras 3. Every Keras 3 optimizer, on
every backend, passes the gradients of an update through
`_clip_gradients` exactly once, after loss-scale unscaling and local
gradient accumulation and before weight decay and the update itself, so
the wrapper reduces them there: clipping then sees the global gradient (as
with Horovod), and with `backward_passes_per_step` only every N-th call
communicates (Keras' own `gradient_accumulation_steps` does the local
accumulation, inside the traced step on TensorFlow).

The wrapper is a subclass of the optimizer's own class with the same name
and module, so `model.save` writes a plain Keras optimizer that any Keras
loads, and `hpdl.keras.load_model` wraps it again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import keras

from hpdl.horovod import basics
from hpdl.horovod.process_sets import ProcessSet, global_process_set
from hpdl.keras import collectives, jit
from hpdl.keras.compression import Compression, check

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "is_distributed"]


@dataclass
class Settings:
    name: str
    compression: Any
    op: int
    prescale: float
    postscale: float
    passes: int
    average_passes: bool
    process_set: ProcessSet
    scale_local: bool = True
    local: set = field(default_factory=set)  # id()s of the worker-local variables


class _Distributed:
    """Mixed in before the optimizer's class: the one hook where the gradients of an update pass."""

    _hpdl: Settings
    _hpdl_variables: list = []

    def _backend_apply_gradients(self, grads: list, trainable_variables: list) -> Any:
        # `_clip_gradients` sees only the gradients: remember whose they are (a Python list, also when traced).
        self._hpdl_variables = list(trainable_variables)
        return super()._backend_apply_gradients(grads, trainable_variables)  # type: ignore[misc]

    def _clip_gradients(self, grads: list) -> list:
        local = _local_mask(self._hpdl, self._hpdl_variables, len(grads))
        grads = _reduce(self._hpdl, grads, local)
        return super()._clip_gradients(grads)  # type: ignore[misc]

    def register_local_var(self, var: Any) -> None:
        """Keep `var`'s gradient on this worker: it is not reduced (Horovod's worker-local variables)."""
        if self.built and not any(v is var for v in self._trainable_variables):  # type: ignore[attr-defined]
            raise ValueError(
                f"register_local_var: {getattr(var, 'path', var)!r} is not a variable this optimizer updates"
            )
        self._hpdl.local.add(id(var))


def is_distributed(optimizer: Any) -> bool:
    inner = getattr(optimizer, "inner_optimizer", None)  # a LossScaleOptimizer around ours
    return isinstance(optimizer, _Distributed) or isinstance(inner, _Distributed)


def DistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    name: Optional[str] = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = basics.Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """Wrap a Keras 3 optimizer so that each update applies the gradients averaged (or summed) over the ranks.

    Horovod's signature. `backward_passes_per_step=N` accumulates N local
    passes and communicates once (summed, or averaged with
    `average_aggregated_gradients=True`, as in Horovod); `compression` casts
    gradients for the wire; `gradient_predivide_factor` splits the average
    before and after the sum. The device, sparse and grouping arguments are
    accepted for compatibility: gradients travel as one group, dense.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"DistributedOptimizer wraps a Keras 3 optimizer (keras.optimizers.*), got {type(optimizer).__name__}"
        )
    if is_distributed(optimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer: wrap the plain optimizer once")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise TypeError(
            "wrap the inner optimizer, not the LossScaleOptimizer: "
            "keras.optimizers.LossScaleOptimizer(hvd.DistributedOptimizer(opt))"
        )
    collectives.backend()
    op = basics.check_op(op)
    if op not in (basics.Average, basics.Sum, basics.Adasum):
        raise ValueError(
            f"op={basics.op_name(op)}: DistributedOptimizer reduces with hvd.Average, hvd.Sum or hvd.Adasum"
        )
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} must be a positive int")
    if gradient_predivide_factor != 1.0 and op != basics.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    own_steps = optimizer.gradient_accumulation_steps
    if own_steps and backward_passes_per_step > 1 and own_steps != backward_passes_per_step:
        raise ValueError(
            f"the optimizer accumulates gradient_accumulation_steps={own_steps} and backward_passes_per_step="
            f"{backward_passes_per_step}: set one of them"
        )
    settings = _settings(
        name or f"DistributedOptimizer.{type(optimizer).__name__}", check(compression), op, gradient_predivide_factor,
        backward_passes_per_step, average_aggregated_gradients, process_set,
    )  # fmt: skip
    settings.scale_local = bool(scale_local_gradients)
    config = optimizer.get_config()
    if backward_passes_per_step > 1:
        config["gradient_accumulation_steps"] = backward_passes_per_step
    wrapped: Any = distributed_class(type(optimizer)).from_config(config)  # type: ignore[attr-defined]
    wrapped._hpdl = settings
    jit.install(is_distributed)
    return wrapped


def PartialDistributedOptimizer(
    optimizer: keras.optimizers.Optimizer,
    name: Optional[str] = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: int = basics.Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> keras.optimizers.Optimizer:
    """A DistributedOptimizer whose `local_layers` keep their gradients on each rank (Horovod's, for Keras 3).

    The trainable variables of `local_layers` are registered with
    `register_local_var`: their gradients are not reduced, and are divided
    by the process set's size when `scale_local_gradients` (as in Horovod).
    Without local layers it is DistributedOptimizer.
    """
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    else:
        local_layers = list(local_layers)
        bad = [type(layer).__name__ for layer in local_layers if not isinstance(layer, keras.layers.Layer)]
        if bad:
            raise ValueError(f"local_layers must be Keras layers (keras.layers.Layer), got {', '.join(bad)}")
    wrapped: Any = DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
        sparse_as_dense=sparse_as_dense, gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step, average_aggregated_gradients=average_aggregated_gradients,
        groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients,
    )  # fmt: skip
    for layer in local_layers:
        for var in layer.trainable_weights:
            wrapped.register_local_var(var)
    return wrapped


def wrap_in_place(optimizer: keras.optimizers.Optimizer, **kwargs: Any) -> keras.optimizers.Optimizer:
    """Make a built optimizer (one that `keras.models.load_model` restored, state and all) distributed."""
    target = optimizer.inner_optimizer if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else optimizer
    if is_distributed(target):
        return optimizer
    op = basics.check_op(kwargs.get("op"))
    target.__class__ = distributed_class(type(target))
    target._hpdl = _settings(
        kwargs.get("name") or f"DistributedOptimizer.{type(target).__name__}",
        check(kwargs.get("compression", Compression.none)), op, 1.0, target.gradient_accumulation_steps or 1,
        kwargs.get("average_aggregated_gradients", False), global_process_set,
    )  # fmt: skip
    jit.install(is_distributed)
    return optimizer


_CLASSES: dict[type, type] = {}


def distributed_class(base: type) -> type:
    """The distributed subclass of `base`, named and placed as `base` (saved files name the plain optimizer)."""
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (_Distributed, base), {"__module__": base.__module__})
        cls.__qualname__ = base.__qualname__
        _CLASSES[base] = cls
    return cls


def _settings(
    name: str, compression: Any, op: int, predivide: float, passes: int, average_passes: bool, ps: ProcessSet
) -> Settings:
    prescale, postscale = 1.0, 1.0
    if op == basics.Average and predivide != 1.0:
        prescale, postscale = 1.0 / predivide, predivide
    return Settings(name, compression, op, prescale, postscale, passes, average_passes, ps)


def _local_mask(settings: Settings, variables: list, n: int) -> list[bool]:
    if not settings.local:
        return [False] * n
    if len(variables) != n:
        raise RuntimeError("hpdl: the optimizer's gradients and variables differ in number; cannot tell local ones")
    return [id(v) in settings.local for v in variables]


def _reduce(settings: Settings, grads: list, local: Optional[list[bool]] = None) -> list:
    """The gradients of this update, reduced over the ranks (Keras averaged any accumulated passes).

    Worker-local gradients stay on this rank, divided by the process set's
    size when `scale_local` (Horovod's scale_local_gradients), so a local
    variable's step matches a shared one's under an averaged loss.
    """
    local = local or [False] * len(grads)
    if settings.passes > 1 and not settings.average_passes:
        # Keras averaged the passes; Horovod's default sums them
        grads = [g if g is None else g * settings.passes for g in grads]
    out = list(grads)
    if any(local):
        scale = 1.0 / (settings.process_set.size() or 1) if settings.scale_local else 1.0
        for i, g in enumerate(grads):
            if local[i] and g is not None and scale != 1.0:
                out[i] = g * scale
    present = [i for i, g in enumerate(grads) if g is not None and not local[i]]
    if not present:
        return out
    wire, contexts = [], []
    for i in present:
        g = grads[i]
        if hasattr(g, "indices") and hasattr(g, "dense_shape"):  # a tf.IndexedSlices (an embedding's gradient)
            import tensorflow as tf

            g = tf.convert_to_tensor(g)
        c, ctx = settings.compression.compress(g)
        wire.append(c)
        contexts.append(ctx)
    reduced = collectives.grouped_allreduce(
        wire, name=settings.name, op=settings.op, prescale_factor=settings.prescale,
        postscale_factor=settings.postscale, process_set=settings.process_set,
    )  # fmt: skip
    for i, r, ctx in zip(present, reduced, contexts):
        out[i] = settings.compression.decompress(r, ctx)
    return out
