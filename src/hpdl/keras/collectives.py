"""The collectives hpdl.keras runs, for the Keras backend in use.

Gradients are reduced where the train step runs: on the torch backend they
are torch tensors and go through hpdl's Horovod engine (`hpdl.horovod`), on
the TensorFlow backend they are `tf.Tensor`s inside a traced step and go
through `hpdl.tensorflow` (a `tf.numpy_function` bridge). Everything else
(callbacks, broadcasts, metrics) runs eagerly between steps, so it goes
through NumPy and the torch engine on every backend: one path to test.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import keras
import numpy as np
import torch

from hpdl.horovod import basics
from hpdl.horovod import ops as torch_ops
from hpdl.horovod.process_sets import ProcessSet, global_process_set

__all__ = ["backend", "grouped_allreduce", "allreduce_array", "broadcast_variables", "broadcast_array"]

SUPPORTED = ("torch", "tensorflow")


def backend() -> str:
    """The Keras backend, checked: hpdl.keras runs on torch and TensorFlow."""
    name = keras.backend.backend()
    if name not in SUPPORTED:
        raise NotImplementedError(
            f"hpdl.keras runs on the torch and tensorflow Keras backends, not {name!r}: set KERAS_BACKEND=torch or "
            "KERAS_BACKEND=tensorflow before Keras is imported"
        )
    return name


def grouped_allreduce(
    tensors: Sequence[Any],
    *,
    name: str,
    op: int,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[Any]:
    """The reductions of the backend's tensors, in one named operation (inside a traced TF step too)."""
    if backend() == "torch":
        return torch_ops.grouped_allreduce(
            [t.detach() for t in tensors], name=name, op=op, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor, process_set=process_set,
        )  # fmt: skip
    import hpdl.tensorflow as hvd_tf  # the TF backend's bridge; imported only there

    return list(
        hvd_tf.grouped_allreduce(
            list(tensors), name=name, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor,
            process_set=process_set,
        )
    )  # fmt: skip


def allreduce_array(
    value: Any, name: str, op: int = basics.Average, process_set: Optional[ProcessSet] = None
) -> np.ndarray:
    """An eager reduction of a NumPy-convertible value (metrics, learning rates) on every backend."""
    array = np.asarray(keras.ops.convert_to_numpy(value) if not isinstance(value, (np.ndarray, float, int)) else value)
    reduced = torch_ops.allreduce(
        torch.from_numpy(np.array(array, dtype=np.float64)), name=name, op=op,
        process_set=process_set if process_set is not None else global_process_set,
    )  # fmt: skip
    return reduced.numpy().reshape(array.shape)


def broadcast_array(value: Any, root_rank: int, name: str) -> np.ndarray:
    array = np.ascontiguousarray(keras.ops.convert_to_numpy(value))
    buf = torch.from_numpy(array.copy())
    torch_ops.broadcast_(buf, root_rank, name=name)
    return buf.numpy().reshape(array.shape)


def broadcast_variables(
    variables: Sequence[Any], root_rank: int, name: str = "broadcast_variables", process_set: Optional[Any] = None
) -> None:
    """Make every rank's Keras variables equal `root_rank`'s, in place (eagerly, between steps).

    Matched by position: the engine checks each variable's shape and dtype on
    every rank, so ranks that hold different models fail with the name of the
    variable that differs instead of training on mixed weights.
    """
    ps = process_set if process_set is not None else global_process_set
    handles = []
    staged: list[Optional[tuple[Any, torch.Tensor]]] = []
    for i, variable in enumerate(variables):
        value = variable.value
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            buf = value.data  # the torch backend's variable itself: broadcast in place, no copy
            staged.append(None)
        else:
            buf = torch.from_numpy(np.ascontiguousarray(keras.ops.convert_to_numpy(value)).copy())
            staged.append((variable, buf))
        handles.append(torch_ops.broadcast_async_(buf, root_rank, name=f"{name}.{i}", process_set=ps))
    for handle in handles:
        torch_ops.synchronize(handle)
    for entry in staged:
        if entry is not None:
            variable, buf = entry
            variable.assign(buf.numpy().reshape(tuple(variable.shape)))
