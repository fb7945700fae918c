"""Horovod's TensorFlow collectives (`horovod.tensorflow.mpi_ops` and the wrappers of `horovod.tensorflow`) on
hpdl's engine, with Horovod's gradients.

Each collective is the `hpdl.horovod.ops` request of the same name (matched by name, checked on every rank),
reached through `hpdl.tensorflow.bridge`: eagerly, or as one graph node inside `tf.function`. The gradients are
Horovod's: allreduce's is the same allreduce, allgather's the averaged slice of this rank, broadcast's the
average on the root (zero elsewhere), alltoall's the reverse alltoall, reducescatter's an allgather.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import tensorflow as tf
import torch
from tensorflow.python.eager import record

from hpdl.horovod import basics
from hpdl.horovod import ops as hops
from hpdl.horovod.basics import Adasum, Average, Sum, check_op
from hpdl.horovod.process_sets import ProcessSet, global_process_set
from hpdl.tensorflow import bridge
from hpdl.tensorflow.compression import Compression

__all__ = [
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "grouped_allgather",
    "broadcast",
    "broadcast_",
    "alltoall",
    "reducescatter",
    "grouped_reducescatter",
    "join",
    "barrier",
    "size_op",
    "local_size_op",
    "rank_op",
    "local_rank_op",
    "process_set_included_op",
]


# --------------------------------------------------------------------------- helpers
def _tensor(t: Any, op: str) -> tf.Tensor:
    if isinstance(t, tf.IndexedSlices):
        raise ValueError(f"{op}: tf.IndexedSlices go through hvd.allreduce / hvd.grouped_allreduce")
    if isinstance(t, tf.Variable):
        return t.read_value() if not tf.executing_eagerly() else tf.convert_to_tensor(t)
    return tf.convert_to_tensor(t)


def tf_variable(v: Any, op: str) -> tf.Variable:
    """The tf.Variable itself, or the one a Keras 3 variable holds on the TensorFlow backend (`.value`)."""
    if isinstance(v, tf.Variable):
        return v
    inner = getattr(v, "value", None)
    if isinstance(inner, tf.Variable):
        return inner
    raise ValueError(
        f"{op} takes tf.Variable or Keras variables (model.variables, optimizer.variables), got {type(v).__name__}; "
        "use hvd.broadcast for tensors"
    )


def _reducible(t: tf.Tensor, op: str) -> tf.Tensor:
    if t.dtype in (tf.uint16, tf.uint32, tf.uint64):
        raise ValueError(f"{op}: tensor type {t.dtype.name} is not supported for reductions; cast to a signed type")
    return t


def _differentiable(
    forward: Callable[[list[tf.Tensor]], list[tf.Tensor]],
    backward: Callable[[list[Optional[tf.Tensor]]], list[Optional[tf.Tensor]]],
    inputs: list[tf.Tensor],
) -> list[tf.Tensor]:
    """`forward(inputs)` with `backward` registered as its gradient (skipped where no tape can record it)."""
    if not any(t.dtype.is_floating or t.dtype.is_complex for t in inputs) or (
        tf.executing_eagerly() and not record.could_possibly_record()
    ):
        return forward(inputs)

    @tf.custom_gradient
    def op(*xs: tf.Tensor) -> Any:
        ys = forward(list(xs))

        def grad(*dys: Optional[tf.Tensor]) -> Any:
            grads = backward(list(dys))
            return grads if len(grads) > 1 else grads[0]

        return (ys if len(ys) > 1 else ys[0]), grad

    out = op(*inputs)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _size(process_set: ProcessSet) -> int:
    return process_set.size() or 1


def _tail(shape: tf.TensorShape) -> list[Optional[int]]:
    return [None, *shape[1:]] if shape.rank else [None]


# --------------------------------------------------------------------------- allreduce
def _allreduce(
    tensor: Any,
    name: Optional[str] = None,
    op: int = Sum,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """Horovod's raw allreduce op (default Sum); its gradient is the same allreduce."""
    return _grouped_allreduce([tensor], name, op, prescale_factor, postscale_factor, ignore_name_scope, process_set)[0]


def _grouped_allreduce(
    tensors: Sequence[Any],
    name: Optional[str] = None,
    op: int = Sum,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor]:
    op = check_op(op)
    xs = [_reducible(_tensor(t, "allreduce"), "allreduce") for t in tensors]
    kind = "allreduce" if len(xs) == 1 else "grouped_allreduce"

    def forward(inputs: list[tf.Tensor]) -> list[tf.Tensor]:
        def fn(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            if len(ts) == 1:
                return [hops.synchronize(hops.allreduce_async(ts[0], None, name, op, prescale_factor,
                                                              postscale_factor, process_set))]  # fmt: skip
            handle = hops.grouped_allreduce_async(ts, None, name, op, prescale_factor, postscale_factor, process_set)
            return list(hops.synchronize(handle))

        return bridge.run(kind, fn, inputs, [x.dtype for x in inputs], [x.shape for x in inputs])

    def backward(dys: list[Optional[tf.Tensor]]) -> list[Optional[tf.Tensor]]:
        grads = [tf.zeros_like(x) if dy is None else dy for x, dy in zip(xs, dys)]
        return _grouped_allreduce(grads, None, op, prescale_factor, postscale_factor, ignore_name_scope, process_set)

    return _differentiable(forward, backward, xs)


def allreduce(
    tensor: Any,
    average: Optional[bool] = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
) -> Any:
    """The reduction of a tf.Tensor, tf.Variable or tf.IndexedSlices across the set (default: the average).

    IndexedSlices are gathered (values and indices), as Horovod does; Average divides the values by the size.
    """
    reduce_op = check_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce([tensor], reduce_op, prescale_factor, postscale_factor, process_set, name)[0]
    compressed, ctx = compression.compress(_tensor(tensor, "allreduce"))
    reduced = _allreduce(compressed, name, reduce_op, prescale_factor, postscale_factor, ignore_name_scope,
                         process_set)  # fmt: skip
    return compression.decompress(reduced, ctx)


def grouped_allreduce(
    tensors: Sequence[Any],
    average: Optional[bool] = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    name: Optional[str] = None,
) -> Any:
    """The reductions of `tensors` as one named operation (fused on the wire); IndexedSlices are gathered."""
    if not tensors:
        return tensors
    reduce_op = check_op(op, average)
    out: list[Any] = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if sparse:
        reduced = _sparse_allreduce([tensors[i] for i in sparse], reduce_op, prescale_factor, postscale_factor,
                                    process_set, name)  # fmt: skip
        for i, r in zip(sparse, reduced):
            out[i] = r
    if dense:
        pairs = [compression.compress(_tensor(tensors[i], "grouped_allreduce")) for i in dense]
        reduced = _grouped_allreduce([p[0] for p in pairs], name, reduce_op, prescale_factor, postscale_factor,
                                     ignore_name_scope, process_set)  # fmt: skip
        for i, r, (_, ctx) in zip(dense, reduced, pairs):
            out[i] = compression.decompress(r, ctx)
    return out


def _sparse_allreduce(
    slices: list[tf.IndexedSlices], op: int, prescale_factor: float, postscale_factor: float,
    process_set: ProcessSet, name: Optional[str],
) -> list[tf.IndexedSlices]:  # fmt: skip
    """Horovod's IndexedSlices reduction: gather every rank's values and indices (a sum of the slices)."""
    if op == Adasum:
        raise NotImplementedError(
            "The Adasum reduction does not currently support sparse tensors. As a workaround please pass "
            "sparse_as_dense=True to DistributedOptimizer"
        )
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")
    values = grouped_allgather([s.values for s in slices], _part(name, "values"), process_set=process_set)
    indices = grouped_allgather([s.indices for s in slices], _part(name, "indices"), process_set=process_set)
    n = _size(process_set)
    return [
        tf.IndexedSlices(v / tf.cast(n, v.dtype) if op == Average else v, i, dense_shape=s.dense_shape)
        for v, i, s in zip(values, indices, slices)
    ]


def _part(name: Optional[str], part: str) -> Optional[str]:
    return None if name is None else f"{name}.{part}"


# --------------------------------------------------------------------------- allgather
def allgather(
    tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:  # fmt: skip
    """Every rank's tensor concatenated along dim 0 (dim 0 may differ between ranks); differentiable."""
    return grouped_allgather([tensor], name, ignore_name_scope, process_set)[0]


def grouped_allgather(
    tensors: Sequence[Any], name: Optional[str] = None, ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor]:  # fmt: skip
    xs = [_tensor(t, "allgather") for t in tensors]
    if not xs:
        return []

    def forward(inputs: list[tf.Tensor]) -> list[tf.Tensor]:
        def fn(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            if len(ts) == 1:
                return [hops.synchronize(hops.allgather_async(ts[0], name, process_set))]
            return list(hops.synchronize(hops.grouped_allgather_async(ts, name, process_set)))

        kind = "allgather" if len(inputs) == 1 else "grouped_allgather"
        return bridge.run(kind, fn, inputs, [x.dtype for x in inputs], [_tail(x.shape) for x in inputs])

    def backward(dys: list[Optional[tf.Tensor]]) -> list[Optional[tf.Tensor]]:
        reduced = [_allreduce(dy, op=Average, process_set=process_set) if dy is not None else None for dy in dys]
        grads: list[Optional[tf.Tensor]] = []
        me = process_set.rank() or 0
        for x, g in zip(xs, reduced):
            if g is None:
                grads.append(None)
                continue
            d = tf.reshape(tf.shape(x, out_type=tf.int32)[0] if x.shape.rank else tf.constant(1), [1])
            dims = allgather(d, process_set=process_set)
            start = tf.reduce_sum(dims[:me])
            grads.append(tf.reshape(g[start : start + dims[me]], tf.shape(x)))
        return grads

    return _differentiable(forward, backward, xs)


# --------------------------------------------------------------------------- broadcast
def broadcast(
    tensor: Any, root_rank: int, name: Optional[str] = None, ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:  # fmt: skip
    """`root_rank`'s tensor (a world rank) on every rank of the set; differentiable."""
    x = _tensor(tensor, "broadcast")

    def forward(inputs: list[tf.Tensor]) -> list[tf.Tensor]:
        def fn(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            return [hops.synchronize(hops.broadcast_async(ts[0], root_rank, name, process_set))]

        return bridge.run("broadcast", fn, inputs, [x.dtype], [x.shape])

    def backward(dys: list[Optional[tf.Tensor]]) -> list[Optional[tf.Tensor]]:
        dy = tf.zeros_like(x) if dys[0] is None else dys[0]
        g = _allreduce(dy, op=Average, process_set=process_set)
        return [g if basics.rank() == root_rank else g * 0]

    return _differentiable(forward, backward, [x])[0]


def broadcast_(
    variables: Sequence[tf.Variable], root_rank: int, name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor]:  # fmt: skip
    """Broadcast `root_rank`'s values into `variables` (one operation for the list); returns their new values."""
    variables = [tf_variable(v, "broadcast_") for v in variables]
    if not variables:
        return []

    def fn(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        handles = [hops.broadcast_async(t, root_rank, _part(name, str(i)), process_set) for i, t in enumerate(ts)]
        return [hops.synchronize(h) for h in handles]

    values = [tf.convert_to_tensor(v) for v in variables]
    outs = bridge.run("broadcast_", fn, values, [v.dtype for v in values], [v.shape for v in values])
    if tf.executing_eagerly():
        for v, o in zip(variables, outs):
            v.assign(o)
        return [v.read_value() for v in variables]
    assigns = [v.assign(o) for v, o in zip(variables, outs)]
    with tf.control_dependencies(assigns):
        return [v.read_value() for v in variables]


# --------------------------------------------------------------------------- alltoall
def alltoall(
    tensor: Any, splits: Any = None, name: Optional[str] = None, ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Any:  # fmt: skip
    """Send `splits[j]` rows of `tensor` to member j (even split without `splits`); returns the received rows,
    and with `splits` also the received splits (int32). Differentiable."""
    x = _tensor(tensor, "alltoall")
    n = _size(process_set)
    given = splits is not None
    if given:
        s = tf.convert_to_tensor(splits)
        if s.dtype not in (tf.int32, tf.int64):
            raise ValueError(f"alltoall: splits must be a tensor of integers (int32), got {s.dtype.name}")
        s = tf.cast(s, tf.int32)
    else:
        s = tf.constant([], dtype=tf.int32)

    def forward(inputs: list[tf.Tensor]) -> list[tf.Tensor]:
        def fn(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            send = [int(v) for v in ts[1].tolist()] if given else None
            out, received = hops.synchronize(hops.alltoall_async(ts[0], send, name, process_set))
            return [out, received]

        return bridge.run("alltoall", fn, [inputs[0], s], [x.dtype, tf.int32], [_tail(x.shape), [n]])

    received: list[tf.Tensor] = []

    def forward_keep(inputs: list[tf.Tensor]) -> list[tf.Tensor]:
        out, rsplits = forward(inputs)
        received.append(rsplits)
        return [out]

    def backward(dys: list[Optional[tf.Tensor]]) -> list[Optional[tf.Tensor]]:
        dy = dys[0]
        if dy is None:
            return [tf.zeros_like(x)]
        grad, _ = alltoall(dy, splits=received[0], process_set=process_set)
        return [tf.reshape(grad, tf.shape(x))]

    out = _differentiable(forward_keep, backward, [x])[0]
    return (out, received[0]) if given else out


# --------------------------------------------------------------------------- reducescatter
def _scatter_shape(shape: tf.TensorShape, process_set: ProcessSet) -> list[Optional[int]]:
    if not shape.rank:
        return [None]
    dim0, n, me = shape[0], _size(process_set), process_set.rank() or 0
    mine = None if dim0 is None else dim0 // n + (1 if me < dim0 % n else 0)
    return [mine, *shape[1:]]


def _grouped_reducescatter(
    tensors: Sequence[Any], name: Optional[str] = None, op: int = Sum, ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> list[tf.Tensor]:  # fmt: skip
    xs = [_reducible(_tensor(t, "reducescatter"), "reducescatter") for t in tensors]
    for x in xs:
        if x.shape.rank == 0:
            raise ValueError("reducescatter: a scalar cannot be scattered; pass a tensor with at least one dimension")

    def forward(inputs: list[tf.Tensor]) -> list[tf.Tensor]:
        def fn(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            if len(ts) == 1:
                handle = hops.reducescatter_async(ts[0], name, op, process_set, prescale_factor, postscale_factor)
                return [hops.synchronize(handle)]
            handle = hops.grouped_reducescatter_async(ts, name, op, process_set, prescale_factor, postscale_factor)
            return list(hops.synchronize(handle))

        kind = "reducescatter" if len(inputs) == 1 else "grouped_reducescatter"
        shapes = [_scatter_shape(x.shape, process_set) for x in inputs]
        return bridge.run(kind, fn, inputs, [x.dtype for x in inputs], shapes)

    def backward(dys: list[Optional[tf.Tensor]]) -> list[Optional[tf.Tensor]]:
        grads: list[Optional[tf.Tensor]] = []
        for x, dy in zip(xs, dys):
            if dy is None:
                grads.append(tf.zeros_like(x))
                continue
            factor = (_size(process_set) if op == Sum else 1.0) * prescale_factor * postscale_factor
            if factor != 1.0:
                dy = dy * tf.cast(factor, dy.dtype)
            grads.append(tf.reshape(allgather(dy, process_set=process_set), tf.shape(x)))
        return grads

    return _differentiable(forward, backward, xs)


def reducescatter(
    tensor: Any, device_dense: str = "", compression: Any = Compression.none, op: int = Average,
    name: Optional[str] = None, process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> tf.Tensor:  # fmt: skip
    """This rank's share of dim 0 of the reduction across the set (default: Average); differentiable."""
    compressed, ctx = compression.compress(_tensor(tensor, "reducescatter"))
    out = _grouped_reducescatter([compressed], name, op, ignore_name_scope, process_set, prescale_factor,
                                 postscale_factor)[0]  # fmt: skip
    return compression.decompress(out, ctx)


def grouped_reducescatter(
    tensors: Sequence[Any], device_dense: str = "", compression: Any = Compression.none, op: int = Average,
    process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
) -> Any:  # fmt: skip
    if not tensors:
        return tensors
    pairs = [compression.compress(_tensor(t, "grouped_reducescatter")) for t in tensors]
    outs = _grouped_reducescatter([p[0] for p in pairs], None, op, False, process_set, prescale_factor,
                                  postscale_factor)  # fmt: skip
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


# --------------------------------------------------------------------------- synchronisation and queries
def join() -> tf.Tensor:
    """This rank is out of data: answer the others' allreduces with zeros until all joined; the last to join."""

    def fn(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        return [torch.tensor(hops.join(), dtype=torch.int32)]

    return bridge.run("join", fn, [], [tf.int32], [[]])[0]


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every member of the set arrives."""

    def fn(ts: list[torch.Tensor]) -> list[torch.Tensor]:
        hops.barrier(process_set)
        return [torch.tensor(0, dtype=torch.int32)]

    bridge.run("barrier", fn, [], [tf.int32], [[]])


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks in the process set, as a tensor (hpdl's world size is fixed for the job)."""
    return tf.constant(_set(process_set_id).size() or 0, dtype=tf.int32, name=name)


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    return tf.constant(int(bool(_set(process_set_id).included())), dtype=tf.int32, name=name)


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    return tf.constant(basics.local_size(), dtype=tf.int32, name=name)


def rank_op(name: Optional[str] = None) -> tf.Tensor:
    return tf.constant(basics.rank(), dtype=tf.int32, name=name)


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    return tf.constant(basics.local_rank(), dtype=tf.int32, name=name)


def _set(process_set_id: int) -> ProcessSet:
    from hpdl.horovod.process_sets import registry

    basics.world()
    ps = registry.sets.get(process_set_id)
    if ps is None:
        raise ValueError(f"process set id {process_set_id} is not known on this rank")
    return ps
