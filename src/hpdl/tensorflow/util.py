"""Horovod's `horovod.tensorflow.util` helpers that scripts and Horovod's tests import."""

from __future__ import annotations

import tensorflow as tf

__all__ = ["_executing_eagerly"]


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs eagerly here (False while a tf.function is traced)."""
    return bool(tf.executing_eagerly())
