"""Horovod's `hvd.SyncBatchNormalization` on Keras 3 (TensorFlow backend): batch statistics of the global batch.

In training, each rank's per-channel count and sum are allreduced (the global mean), then its sum of squared
deviations from that mean (the global variance), so every rank normalises with the statistics of the
concatenated batch, whatever each rank's share of it. Two passes, as `hpdl.horovod.SyncBatchNorm`: Horovod's
one pass, E[x^2] - E[x]^2, loses the variance to cancellation in float32 where the mean is large. The gradients
flow through the allreduces (each one's gradient is the allreduce of the gradient), which gives the exact
gradient of batch norm over the global batch. Outside training, and on one rank, it is Keras' layer.
"""

from __future__ import annotations

from typing import Any, Optional

import keras
import tensorflow as tf

from hpdl.horovod.basics import Sum
from hpdl.horovod.process_sets import ProcessSet, global_process_set
from hpdl.tensorflow.ops import allreduce

__all__ = ["SyncBatchNormalization"]


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """keras.layers.BatchNormalization whose training statistics cover every rank's batch (Horovod's API:
    `fused` is accepted only as False; `process_set` picks the ranks that share statistics and is not saved in
    the config: a loaded model shares them over every rank)."""

    def __init__(self, fused: Optional[bool] = False, process_set: ProcessSet = global_process_set, **kwargs: Any):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True (as Horovod's); leave `fused` out")
        if kwargs.get("synchronized"):
            raise ValueError(
                "SyncBatchNormalization synchronizes through hpdl; synchronized=True is Keras' tf.distribute path"
            )
        if keras.backend.backend() != "tensorflow":
            raise ValueError(
                f"hpdl.tensorflow.SyncBatchNormalization needs Keras' TensorFlow backend (KERAS_BACKEND is "
                f"{keras.backend.backend()!r}); on torch use hpdl.horovod.SyncBatchNorm"
            )
        super().__init__(**kwargs)
        self.process_set = process_set

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        if (self.process_set.size() or 1) <= 1:
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        x = tf.convert_to_tensor(inputs)
        if mask is None:
            weight = None
            total = tf.reduce_sum(x, axes, keepdims=True)
            count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype) * tf.ones_like(total)
        else:  # Keras' masks drop positions (the mask has the input's shape without the channel axis)
            weight = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), x.dtype)
            total = tf.reduce_sum(x * weight, axes, keepdims=True)
            count = tf.reduce_sum(weight, axes, keepdims=True)
        both = allreduce(tf.stack([count, total]), op=Sum, process_set=self.process_set)
        n = both[0] if weight is None else both[0] + keras.backend.epsilon()  # (as Keras' masked path)
        mean = both[1] / n
        squares = tf.square(x - mean) if weight is None else tf.square(x - mean) * weight
        variance = allreduce(tf.reduce_sum(squares, axes, keepdims=True), op=Sum, process_set=self.process_set) / n
        return tf.squeeze(mean, axes), tf.squeeze(variance, axes)
