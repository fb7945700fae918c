"""Elastic training state: objects, a model and an optimizer that commit, restore and sync together."""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch

__all__ = ["State", "ObjectState", "TorchState"]


class State:
    """Base: `commit()` saves a restore point, `restore()` returns to it, `sync()` takes rank 0's state."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Functions to call after a reset (for example to rescale the learning rate)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the current state as the restore point, then check for host changes (none in hpdl)."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod raises HostsUpdatedInterrupt here when hosts changed; hpdl's world is fixed."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        pass


class ObjectState(State):
    """Picklable attributes (`state.epoch`, `state.batch`, ...) kept in step across ranks."""

    def __init__(self, **kwargs: Any):
        super().__init__()
        self._saved_state = dict(kwargs)
        for name, value in kwargs.items():
            object.__setattr__(self, name, value)

    def save(self) -> None:
        self._saved_state = {k: copy.deepcopy(getattr(self, k)) for k in self._saved_state}

    def restore(self) -> None:
        for k, v in self._saved_state.items():
            object.__setattr__(self, k, copy.deepcopy(v))

    def sync(self) -> None:
        from hpdl.horovod.functions import broadcast_object

        if self._saved_state:
            current = {k: getattr(self, k) for k in self._saved_state}
            synced = broadcast_object(current, root_rank=0, name="elastic.object_state")
            for k, v in synced.items():
                object.__setattr__(self, k, v)
            self._saved_state = {k: copy.deepcopy(v) for k, v in synced.items()}


class TorchState(ObjectState):
    """A model, an optimizer and any other attributes (samplers with `state_dict` too) for `hvd.elastic.run`."""

    _handled: dict[str, Any]
    _saved_dicts: dict[str, Any]

    def __init__(self, model: Optional[torch.nn.Module] = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 **kwargs: Any):  # fmt: skip
        handled = {k: v for k, v in kwargs.items() if _has_state_dict(v)}
        plain = {k: v for k, v in kwargs.items() if k not in handled}
        if model is not None:
            handled["model"] = model
        if optimizer is not None:
            handled["optimizer"] = optimizer
        object.__setattr__(self, "_handled", handled)
        object.__setattr__(self, "_saved_dicts", {})
        super().__init__(**plain)
        for name, value in handled.items():
            object.__setattr__(self, name, value)
        self._save_handled()

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__.get("_handled", {}):
            self._handled[name] = value
        object.__setattr__(self, name, value)

    def _save_handled(self) -> None:
        self._saved_dicts = {k: copy.deepcopy(v.state_dict()) for k, v in self._handled.items()}

    def save(self) -> None:
        self._save_handled()
        super().save()

    def restore(self) -> None:
        for k, sd in self._saved_dicts.items():
            self._handled[k].load_state_dict(copy.deepcopy(sd))
        super().restore()

    def sync(self) -> None:
        from hpdl.horovod.functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

        for k, v in self._handled.items():
            if isinstance(v, torch.nn.Module):
                broadcast_parameters(v.state_dict(), root_rank=0, prefix=f"elastic.{k}")
            elif isinstance(v, torch.optim.Optimizer):
                broadcast_optimizer_state(v, root_rank=0)
            else:
                v.load_state_dict(broadcast_object(v.state_dict(), root_rank=0, name=f"elastic.{k}"))
        self._save_handled()
        super().sync()


def _has_state_dict(v: Any) -> bool:
    return callable(getattr(v, "state_dict", None)) and callable(getattr(v, "load_state_dict", None))
