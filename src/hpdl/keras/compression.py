"""Horovod's gradient compression for Keras: a Compressor casts a tensor for the wire and back.

Written with `keras.ops`, so one compressor serves every backend and runs
inside a traced train step (`tf.function`) as well as eagerly. The interface and
`Compressor`/`NoneCompressor` are `hpdl.horovod.compression`'s.
"""

from __future__ import annotations

from typing import Any

from keras import ops

from hpdl.horovod.compression import Compressor, NoneCompressor

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression"]

_FLOATS = ("float16", "bfloat16", "float32", "float64")


class _CastCompressor(Compressor):
    wire = "float16"

    @classmethod
    def compress(cls, tensor: Any) -> tuple[Any, Any]:  # type: ignore[override]
        dtype = ops.dtype(tensor)
        if dtype in _FLOATS and dtype != cls.wire:
            return ops.cast(tensor, cls.wire), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor if ctx is None else ops.cast(tensor, ctx)


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16 (Horovod's `Compression.fp16`)."""

    wire = "float16"


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16 (float32's range, half the bytes)."""

    wire = "bfloat16"


class Compression:
    """Optional compression for `DistributedOptimizer` and `allreduce`."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def check(compression: Any) -> Any:
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise TypeError(
            f"compression={compression!r} is not a Compressor: pass hvd.Compression.none, hvd.Compression.fp16 "
            "or a class with compress(tensor) -> (tensor, ctx) and decompress(tensor, ctx)"
        )
    return compression
