"""Horovod's DistributedGradientTape and PartialDistributedGradientTape on hpdl.

`tape.gradient` returns the gradients averaged (or summed) across the process set: the dense ones in one
grouped allreduce (one engine request and one graph node per group, fused on the wire), IndexedSlices gathered
(values and indices) unless `sparse_as_dense`, as Horovod does. Registered local sources keep their own
gradient (divided by the set's size with `scale_local_gradients`).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

import tensorflow as tf

from hpdl.horovod.basics import Average
from hpdl.horovod.process_sets import ProcessSet, global_process_set
from hpdl.tensorflow import ops
from hpdl.tensorflow.compression import Compression

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape", "allreduce_gradients"]


def allreduce_gradients(
    grads: Sequence[Any],
    variables: Optional[Sequence[Any]] = None,
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
) -> list[Any]:
    """Reduce a list of gradients (None kept) as Horovod's tape and optimizer do; `hpdl.keras` calls this too.

    `groups`: None (all dense gradients in one grouped allreduce), an int (that many groups, split in order) or a
    list of lists of variables (each list one group; the rest one group each).
    """
    if op == Average:
        prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    else:
        prescale = postscale = 1.0
    grads = list(grads)
    if sparse_as_dense:
        grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]
    if not process_set.included() or (process_set.size() or 1) <= 1:
        return grads  # (Horovod's _allreduce_cond)
    present = [i for i, g in enumerate(grads) if g is not None]
    out: list[Any] = list(grads)
    for group in _split(present, grads, variables, groups):
        reduced = ops.grouped_allreduce(
            [grads[i] for i in group], compression=compression, op=op, prescale_factor=prescale,
            postscale_factor=postscale, process_set=process_set,
        )  # fmt: skip
        for i, r in zip(group, reduced):
            out[i] = r
    return out


def _split(present: list[int], grads: list[Any], variables: Optional[Sequence[Any]], groups: Any) -> list[list[int]]:
    if not present:
        return []
    if groups is None:
        return [present]
    if isinstance(groups, int):
        if groups <= 0:
            raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")
        k = min(groups, len(present))
        size, extra = divmod(len(present), k)
        out, start = [], 0
        for j in range(k):
            end = start + size + (1 if j < extra else 0)
            out.append(present[start:end])
            start = end
        return out
    if variables is None:
        raise ValueError("groups given as lists of variables need the variables the gradients belong to")
    position = {_key(v): i for i, v in enumerate(variables) if i in present}
    out = []
    for group in groups:
        members = [position.pop(_key(v)) for v in group if _key(v) in position]
        if members:
            out.append(members)
    out += [[i] for i in sorted(position.values())]
    return out


def _key(source: Any) -> Any:
    """A hashable identity for a tf.Variable (`ref()`) or a Keras 3 variable (which has no `ref`)."""
    ref = getattr(source, "ref", None)
    return ref() if callable(ref) else id(source)


class _DistributedGradientTape(tf.GradientTape):
    """Mixed into the wrapped tape's own class (Horovod's construction): `gradient` reduces across ranks."""

    def _hvd_setup(self, compression: Any, sparse_as_dense: bool, op: int, gradient_predivide_factor: float,
                   groups: Any, process_set: ProcessSet, scale_local_gradients: bool) -> None:  # fmt: skip
        self._hvd_args = dict(
            compression=compression, sparse_as_dense=sparse_as_dense, op=op,
            gradient_predivide_factor=gradient_predivide_factor, groups=groups, process_set=process_set,
        )  # fmt: skip
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_sources: set = set()

    def register_local_source(self, source: Any) -> None:
        """This source's gradient stays local (not reduced across ranks)."""
        self._local_sources.add(_key(source))

    def gradient(
        self, target: Any, sources: Any, output_gradients: Any = None, unconnected_gradients: Any = None,
        use_generic_names: bool = False,
    ) -> Any:  # fmt: skip
        kwargs = {} if unconnected_gradients is None else {"unconnected_gradients": unconnected_gradients}
        gradients = super().gradient(target, sources, output_gradients, **kwargs)
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(gradients, expand_composites=False)
        shared = [i for i, s in enumerate(flat_sources) if _key(s) not in self._local_sources]
        reduced = allreduce_gradients([flat_grads[i] for i in shared], [flat_sources[i] for i in shared],
                                      **self._hvd_args)  # fmt: skip
        for i, g in zip(shared, reduced):
            flat_grads[i] = g
        if self.scale_local_gradients and self._local_sources:
            n = float(self.process_set.size() or 1)
            for i, s in enumerate(flat_sources):
                g = flat_grads[i]
                if _key(s) in self._local_sources and g is not None:
                    if isinstance(g, tf.IndexedSlices):
                        flat_grads[i] = tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
                    else:
                        flat_grads[i] = g / n
        return tf.nest.pack_sequence_as(sources, flat_grads)

    def get_local_and_global_gradients(
        self, target: Any, sources: Any, output_gradients: Any = None, use_generic_names: bool = False
    ) -> tuple[list, list]:
        grads = self.gradient(target, sources, output_gradients)
        local: list = []
        shared: list = []
        for s, g in zip(sources, grads):
            (local if _key(s) in self._local_sources else shared).append((s, g))
        return local, shared


def DistributedGradientTape(
    gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "", compression: Any = Compression.none,
    sparse_as_dense: bool = False, op: int = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
    groups: Any = None, process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True,
) -> tf.GradientTape:  # fmt: skip
    """A tape whose `gradient` returns gradients reduced across the process set (default: averaged).

    Wraps a used tape (`with tf.GradientTape() as tape: ...` then `tape = hvd.DistributedGradientTape(tape)`) or a
    fresh one used as the context manager.
    """
    if not isinstance(gradtape, tf.GradientTape):
        raise ValueError(f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups`.", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if groups is not None and not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")
    cls: Any = type(gradtape)
    if not issubclass(cls, _DistributedGradientTape):
        cls = type(cls.__name__, (_DistributedGradientTape, cls), {})
    tape = object.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)  # the recorded tape itself, persistence, watched variables
    tape._hvd_setup(compression, sparse_as_dense, op, gradient_predivide_factor, groups, process_set,
                    scale_local_gradients)  # fmt: skip
    return tape


def PartialDistributedGradientTape(
    gradtape: tf.GradientTape, device_dense: str = "", device_sparse: str = "", compression: Any = Compression.none,
    sparse_as_dense: bool = False, op: int = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
    groups: Any = None, process_set: ProcessSet = global_process_set, local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> tf.GradientTape:  # fmt: skip
    """DistributedGradientTape whose `local_layers` (Keras layers) keep their own gradients."""
    import keras

    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of keras.layers.Layer type.")
    tape = DistributedGradientTape(
        gradtape, device_dense, device_sparse, compression, sparse_as_dense, op, gradient_predivide_factor,
        num_groups, groups, process_set, scale_local_gradients,
    )  # fmt: skip
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)  # type: ignore[attr-defined]
    return tape
