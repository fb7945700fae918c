"""Count the bytes of activations that autograd keeps for backward, live and at their peak.

`ActivationMeter` hooks `torch.autograd.graph.saved_tensors_hooks`: every
tensor a graph saves for backward is counted once per storage (views of one
tensor share it) until the graph lets it go. Parameters are not
activations and are left out. The same meter measures hpdl's pipeline and
torch.distributed.pipelining in the benchmark, so their peaks compare.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

import torch
from torch import nn

__all__ = ["ActivationMeter"]


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ActivationMeter:
    """Use as a context manager around forward/backward work; `peak` and `live` are in bytes."""

    def __init__(self, exclude: Optional[Iterable[torch.Tensor]] = None):
        self.live = 0
        self.peak = 0
        self._storages: dict[int, list[int]] = {}
        self._exclude = {t.untyped_storage().data_ptr() for t in (exclude or ())}
        self._hooks: Optional[Any] = None

    def reset_peak(self) -> None:
        self.peak = self.live

    def _pack(self, tensor: torch.Tensor) -> Any:
        if isinstance(tensor, nn.Parameter):
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._exclude or storage.nbytes() == 0:
            return tensor
        entry = self._storages.get(key)
        if entry is None:
            self._storages[key] = [1, storage.nbytes()]
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        else:
            entry[0] += 1
        holder = _Saved(tensor)
        weakref.finalize(holder, self._drop, key)
        return holder

    def _drop(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._storages[key]

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None
