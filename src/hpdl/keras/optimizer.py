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

from dataclasses import dataclass
from typing import Any, Optional

import keras

from hpdl.horovod import basics
from hpdl.horovod.process_sets import ProcessSet, global_process_set
from hpdl.keras import collectives, jit
from hpdl.keras.compression import Compression, check

__all__ = ["DistributedOptimizer", "is_distributed"]


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


class _Distributed:
    """Mixed in before the optimizer's class: the one hook where the gradients of an update pass."""

    _hpdl: Settings

    def _clip_gradients(self, grads: list) -> list:
        grads = _reduce(self._hpdl, grads)
        return super()._clip_gradients(grads)  # type: ignore[misc]


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
    config = optimizer.get_config()
    if backward_passes_per_step > 1:
        config["gradient_accumulation_steps"] = backward_passes_per_step
    wrapped: Any = distributed_class(type(optimizer)).from_config(config)  # type: ignore[attr-defined]
    wrapped._hpdl = settings
    jit.install(is_distributed)
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


def _reduce(settings: Settings, grads: list) -> list:
    """The gradients of this update, reduced over the ranks (Keras averaged any accumulated passes)."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if not present:
        return grads
    wire, contexts = [], []
    for i in present:
        g = grads[i]
        if settings.passes > 1 and not settings.average_passes:
            g = g * settings.passes  # Keras averaged the passes; Horovod's default sums them
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
    out = list(grads)
    for i, r, ctx in zip(present, reduced, contexts):
        out[i] = settings.compression.decompress(r, ctx)
    return out
