"""Horovod's gradient compression: a Compressor casts a tensor for the wire and back.

`Compression.none` and `Compression.fp16` are Horovod's; `Compression.bf16`
is hpdl's addition. A user's own `Compressor` subclass (static `compress`
returning `(tensor, ctx)` and `decompress(tensor, ctx)`) works wherever
Horovod accepts one.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Compression", "wire_name"]


class Compressor:
    """Interface: `compress(tensor) -> (tensor, ctx)`, `decompress(tensor, ctx) -> tensor`."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression (the default)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    wire: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:  # type: ignore[override]
        if tensor.dtype.is_floating_point:
            return tensor.type(cls.wire), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor.type(ctx) if ctx is not None and ctx.is_floating_point else tensor


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16."""

    wire = torch.float16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16 (hpdl's addition: float32's range, half the bytes)."""

    wire = torch.bfloat16


class Compression:
    """Optional compression for allreduce and DistributedOptimizer."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def wire_name(compression: Any) -> Optional[str]:
    """The gradient buckets' wire dtype name for a built-in compressor; '' for a user's own Compressor."""
    if compression is None or compression is NoneCompressor or isinstance(compression, NoneCompressor):
        return None
    if compression is FP16Compressor or isinstance(compression, FP16Compressor):
        return "fp16"
    if compression is BF16Compressor or isinstance(compression, BF16Compressor):
        return "bf16"
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"compression={compression!r} is not a Compressor (it needs compress and decompress)")
    return ""
