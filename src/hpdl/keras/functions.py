"""Horovod's `horovod.keras` value functions on Keras 3: reduce, gather and broadcast values between steps,
and `load_model`, which wraps a saved model's optimizer again."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import keras
import numpy as np
import torch

from hpdl.horovod import basics
from hpdl.horovod import ops as torch_ops
from hpdl.keras import collectives
from hpdl.keras.compression import Compression
from hpdl.keras.optimizer import wrap_in_place

__all__ = ["allreduce", "allgather", "broadcast", "broadcast_variables", "broadcast_global_variables", "load_model"]


def allreduce(
    value: Any, name: Optional[str] = None, average: Optional[bool] = None, op: Optional[int] = None,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> Any:  # fmt: skip
    """The reduction of `value` (a number, array or tensor) over the ranks, as a backend tensor."""
    resolved = basics.check_op(op, average)
    array = np.asarray(keras.ops.convert_to_numpy(value))
    buf = torch.from_numpy(array.copy())
    out = torch_ops.allreduce(
        buf, name=name or "keras.allreduce", op=resolved, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
    )  # fmt: skip
    return keras.ops.convert_to_tensor(out.numpy())


def allgather(value: Any, name: Optional[str] = None) -> Any:
    """Every rank's `value` concatenated along the first axis (their first dimensions may differ)."""
    array = np.asarray(keras.ops.convert_to_numpy(value))
    out = torch_ops.allgather(torch.from_numpy(array.copy()), name=name or "keras.allgather")
    return keras.ops.convert_to_tensor(out.numpy())


def broadcast(value: Any, root_rank: int, name: Optional[str] = None) -> Any:
    """`root_rank`'s `value` on every rank."""
    return keras.ops.convert_to_tensor(collectives.broadcast_array(value, root_rank, name or "keras.broadcast"))


def broadcast_variables(variables: Sequence[Any], root_rank: int) -> None:
    """Assign `root_rank`'s values to these Keras variables on every rank (eagerly)."""
    collectives.broadcast_variables(list(variables), root_rank)


def broadcast_global_variables(root_rank: int, model: Optional[keras.Model] = None) -> None:
    """Keras 2's global broadcast: Keras 3 has no global variable collection, so name the model."""
    if model is None:
        raise ValueError(
            "broadcast_global_variables: Keras 3 keeps no global variables; pass model=, or use "
            "hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank) in fit"
        )
    variables = list(model.weights)
    if getattr(model, "optimizer", None) is not None and model.optimizer.built:
        variables += list(model.optimizer.variables)
    collectives.broadcast_variables(variables, root_rank, name="broadcast_global_variables")


def load_model(
    filepath: str,
    custom_optimizers: Optional[Sequence[type]] = None,
    custom_objects: Optional[dict] = None,
    compression: Any = Compression.none,
    **load_kwargs: Any,
) -> keras.Model:
    """`keras.models.load_model`, with the saved optimizer (and its state) wrapped as a DistributedOptimizer.

    Saved files hold the plain optimizer (the wrapper saves as its base
    class), so any Keras loads them; `custom_optimizers` are optimizer
    classes of the user's own that the file names.
    """
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects, **load_kwargs)
    if getattr(model, "optimizer", None) is not None:
        wrap_in_place(model.optimizer, compression=compression)
    return model
