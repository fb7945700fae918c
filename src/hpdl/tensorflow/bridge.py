"""How TensorFlow tensors reach hpdl's Horovod engine: NumPy views in, DLPack out, `tf.numpy_function` in graphs.

hpdl's engine (`hpdl.horovod.engine`, the one that checks that ranks agree) works on torch tensors. A CPU
`EagerTensor` exposes its buffer as a NumPy array without a copy (`_numpy()`), `torch.from_numpy` views that,
and a result travels back through DLPack, also without a copy: an operation's only copy is the one it needs
(the output buffer). GPU tensors are staged through the host.

Eager code calls the engine directly. Inside `tf.function` (how `model.fit` runs a step) each operation is one
`tf.numpy_function` node: it is stateful, so TensorFlow's automatic control dependencies run the nodes in program
order, the same order on every rank, which the engine's matching of unnamed operations needs. It hands the
callback NumPy views, which the engine takes as they are (`tf.py_function` wraps them in EagerTensors; the
per-call costs are in docs/keras.md). TF1 graphs get the same order from explicit control dependencies.
The node's errors get their class from the small compiled op after it (`status_op`: FailedPreconditionError where
ranks disagree, InvalidArgumentError for bad arguments); where that op cannot be built they are UnknownError.
XLA cannot compile a Python callback: `jit_compile=True` is refused with a clear error.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import tensorflow as tf
import torch
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.framework.func_graph import FuncGraph
from tensorflow.python.ops import control_flow_util

from hpdl.horovod.basics import HorovodInternalError as _TorchHorovodInternalError
from hpdl.tensorflow import status_op

__all__ = ["HorovodInternalError", "run", "tf_errors", "to_torch", "to_numpy", "from_torch", "check_not_xla"]


class HorovodInternalError(tf.errors.FailedPreconditionError, _TorchHorovodInternalError):
    """A collective failed (ranks disagree, or one is missing): TensorFlow's FailedPreconditionError, as Horovod
    raises it, and hpdl's HorovodInternalError. Graph nodes raise it through the compiled HpdlStatus op
    (`status_op`); without that op TensorFlow turns it into an UnknownError with the same message."""

    def __init__(self, message: str):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)


class InvalidArgumentError(tf.errors.InvalidArgumentError, ValueError):
    """Bad arguments found by the engine (TensorFlow's InvalidArgumentError, as inside a graph, and a ValueError)."""

    def __init__(self, message: str):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


def check_not_xla(what: str) -> None:
    if control_flow_util.GraphOrParentsInXlaContext(tf_ops.get_default_graph()):
        raise NotImplementedError(
            f"hpdl.tensorflow.{what} cannot run inside an XLA-compiled function (tf.function(jit_compile=True), "
            "or Keras' jit_compile=True): its collectives are Python callbacks, which XLA cannot compile. "
            "Use jit_compile=False for the train step."
        )


_BF16 = tf.bfloat16.as_numpy_dtype
_OK = b""
"""The status of a collective that succeeded (HpdlStatus passes the outputs through)."""

_ONE_AT_A_TIME = threading.Lock()
"""TensorFlow may run independent graph nodes on several threads; the engine and MPI take one call at a time."""

_LAST_NODE: weakref.WeakKeyDictionary[tf.Graph, tf.Operation] = weakref.WeakKeyDictionary()
"""TF1 graphs (sessions) have no automatic control dependencies: each hpdl node there depends on the one created
before it in its graph, so every rank runs them in the order the program built them (a fetched node also runs
the hpdl nodes built before it). `tf.function` graphs order stateful nodes themselves."""


def to_numpy(t: Any) -> np.ndarray:
    """A NumPy view of a CPU tensor (a host copy of a GPU one); never write into it."""
    if isinstance(t, np.ndarray):
        return t
    if isinstance(t, tf.Variable):
        t = t.value()
    if not isinstance(t, tf.Tensor):
        t = tf.convert_to_tensor(t)
    a = t._numpy()  # the buffer itself on CPU; .numpy() would copy it
    return a if isinstance(a, np.ndarray) else np.asarray(a)  # a 0-d tensor gives a NumPy scalar


def to_torch(a: np.ndarray) -> torch.Tensor:
    """A torch view of a NumPy array: bfloat16 through its bits (NumPy has no bfloat16 of its own), uint16 as
    int16 (the engine has no uint16; the operations that move it are bit-exact, reductions refuse it)."""
    if a.dtype == _BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if a.dtype == np.uint16:
        return torch.from_numpy(a.view(np.int16))
    return torch.from_numpy(a)


def torch_to_numpy(t: torch.Tensor, dtype: Optional[tf.DType] = None) -> np.ndarray:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16)
    if dtype == tf.uint16:
        return t.numpy().view(np.uint16)
    return t.numpy()


def from_torch(t: torch.Tensor, device: Optional[str] = None, dtype: Optional[tf.DType] = None) -> tf.Tensor:
    """A tf.Tensor on the torch tensor's memory (DLPack), copied to `device` when that is a GPU."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    try:
        out = tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(t))
    except Exception:  # (a layout DLPack does not take): a copy
        out = tf.convert_to_tensor(torch_to_numpy(t))
    if dtype is not None and out.dtype != dtype:
        out = tf.bitcast(out, dtype)  # uint16, carried as int16
    if device and "GPU" in device.upper():
        with tf.device(device):
            out = tf.identity(out)
    return out


def run(
    name: str,
    fn: Callable[[list[torch.Tensor]], Sequence[torch.Tensor]],
    inputs: Sequence[Any],
    out_dtypes: Sequence[tf.DType],
    out_shapes: Sequence[Any],
) -> list[tf.Tensor]:
    """Run `fn` (torch tensors in, torch tensors out) on `inputs`, eagerly or as one graph node.

    `out_shapes`: the static shapes the graph node's outputs get (None entries: unknown dimensions).
    """
    if tf.executing_eagerly():
        device = _device(inputs)
        try:
            outs = fn([to_torch(to_numpy(t)) for t in inputs])
        except _TorchHorovodInternalError as exc:
            raise _as_tf_error(exc) from exc
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from exc
        return [from_torch(o, device, d) for o, d in zip(outs, out_dtypes)]
    check_not_xla(name)
    lib = status_op.library()

    def failed(code: int, exc: BaseException) -> list[Any]:
        """Empty outputs and the status HpdlStatus raises (without the op: the exception, an UnknownError)."""
        if lib is None:
            raise _as_tf_error(exc) if code == status_op.FAILED_PRECONDITION else exc
        return [*(np.empty((0,), d.as_numpy_dtype) for d in out_dtypes), f"{code}:{exc}".encode()]

    def call(*arrays: np.ndarray) -> list[Any]:
        with _ONE_AT_A_TIME:
            try:
                outs = fn([to_torch(a) for a in arrays])
            except _TorchHorovodInternalError as exc:
                return failed(status_op.FAILED_PRECONDITION, exc)
            except ValueError as exc:
                return failed(status_op.INVALID_ARGUMENT, exc)
            results = [torch_to_numpy(o, d) for o, d in zip(outs, out_dtypes)]
        return results if lib is None else [*results, _OK]

    graph = tf_ops.get_default_graph()
    previous = None if isinstance(graph, FuncGraph) else _LAST_NODE.get(graph)
    types = list(out_dtypes) if lib is None else [*out_dtypes, tf.string]
    with tf.control_dependencies([previous] if previous is not None else []):
        results = tf.numpy_function(call, list(inputs), types, stateful=True, name=f"hpdl_{name}")
        if not isinstance(results, (list, tuple)):
            results = [results]
        if lib is not None:
            results = lib.hpdl_status(results[-1], list(results[:-1]), name=f"hpdl_{name}_status")
    if not isinstance(graph, FuncGraph) and results:
        _LAST_NODE[graph] = results[0].op
    for r, shape in zip(results, out_shapes):
        r.set_shape(shape)
    return list(results)


@contextlib.contextmanager
def tf_errors() -> Iterator[None]:
    """The engine's errors as TensorFlow's (for calls that reach it without a bridge node: objects)."""
    try:
        yield
    except _TorchHorovodInternalError as exc:
        raise _as_tf_error(exc) from exc


def _as_tf_error(exc: BaseException) -> HorovodInternalError:
    if isinstance(exc, HorovodInternalError):
        return exc
    return HorovodInternalError(str(exc))


def _device(inputs: Sequence[Any]) -> Optional[str]:
    for t in inputs:
        device = getattr(t, "device", None)
        if device:
            return str(device)
    return None
