"""Accepting torch tensors and NumPy arrays alike, and checking them before any rank waits.

Internally every collective works on a torch tensor; a NumPy array is viewed
as one (`torch.from_numpy` shares memory) and results go back to the caller
as the kind of object the caller passed.
"""

from __future__ import annotations

from typing import Any, Union

import numpy as np
import torch

__all__: list[str] = []

ArrayLike = Union[torch.Tensor, np.ndarray]

REDUCE_OPS = ("sum", "avg", "max", "min", "prod")


def as_tensor(value: Any, op: str) -> torch.Tensor:
    """A torch view of `value` (no copy), or a TypeError that says what is accepted."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        try:
            return torch.from_numpy(value)
        except TypeError as exc:
            raise TypeError(f"{op}: NumPy dtype {value.dtype} has no torch equivalent ({exc})") from None
    raise TypeError(f"{op}: expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")


def like_input(result: torch.Tensor, original: Any) -> ArrayLike:
    """Return `result` as the same kind of object the caller passed in."""
    if isinstance(original, np.ndarray):
        return result.numpy()
    return result


def check_contiguous(tensor: torch.Tensor, op: str) -> None:
    if not tensor.is_contiguous():
        raise ValueError(
            f"{op}: tensor of shape {tuple(tensor.shape)} with strides {tensor.stride()} is not "
            "contiguous; pass tensor.contiguous() (and copy the result back if you need it in place)"
        )


def check_reduce_op(op: str, dtype: torch.dtype, name: str) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"{name}: unknown op {op!r}; use one of {', '.join(REDUCE_OPS)}")
    if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(
            f"{name}: op='avg' needs a floating-point tensor, got {dtype}; "
            "use op='sum' and divide by comm.size yourself"
        )
    if dtype.is_complex and op in ("max", "min"):
        raise ValueError(f"{name}: op={op!r} is undefined for complex dtype {dtype}")


def check_same_device_dtype(a: torch.Tensor, b: torch.Tensor, op: str) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"{op}: dtype mismatch, {a.dtype} vs {b.dtype}; both tensors must have one dtype")
    if a.device != b.device:
        raise ValueError(f"{op}: device mismatch, {a.device} vs {b.device}; move both to one device")


def check_root(root: int, size: int, op: str) -> None:
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < size:
        raise ValueError(f"{op}: root={root!r} is out of range; it must be an int in [0, {size - 1}]")


def check_peer(peer: int, size: int, rank: int, op: str, what: str) -> None:
    if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < size:
        raise ValueError(f"{op}: {what}={peer!r} is out of range; it must be an int in [0, {size - 1}]")
    if peer == rank:
        raise ValueError(f"{op}: {what}={peer} is this rank itself; point-to-point needs another rank")


def check_divisible(tensor: torch.Tensor, size: int, op: str) -> None:
    if tensor.dim() == 0 or tensor.shape[0] % size != 0:
        dim0 = tensor.shape[0] if tensor.dim() else "a 0-d tensor"
        raise ValueError(
            f"{op}: dim 0 ({dim0}) must divide evenly by the communicator size {size}; pad it to a multiple of {size}"
        )
