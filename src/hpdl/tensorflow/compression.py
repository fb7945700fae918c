"""Horovod's gradient compression for TensorFlow tensors: cast for the wire, cast back after.

The interface and the `Compressor`/`NoneCompressor` classes of `hpdl.horovod.compression` (static `compress(tensor)
-> (tensor, ctx)` and `decompress(tensor, ctx)`), with `tf.cast` in place of torch's, so a user's own Compressor
keeps working.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from hpdl.horovod.compression import Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]


class _CastCompressor(Compressor):
    wire = tf.float16

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:  # type: ignore[override]
        if tensor.dtype.is_floating:
            return tf.cast(tensor, cls.wire), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        if ctx is not None and ctx.is_floating:
            return tf.cast(tensor, ctx)
        return tensor


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16."""

    wire = tf.float16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16 (hpdl's addition: float32's range, half the bytes)."""

    wire = tf.bfloat16


class Compression:
    """Optional compression for allreduce, DistributedGradientTape and DistributedOptimizer."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
