"""The state of a wrapping optimizer is its inner optimizer's: one mechanism for every wrapper.

A wrapper (ZeRO's sharded optimizer, the Horovod-style DistributedOptimizer)
subclasses `torch.optim.Optimizer` so that LR schedulers and `isinstance`
checks accept it, but the real `param_groups` and `state` live in the inner
optimizer, stored as `self.optimizer`. The inner optimizer's
`load_state_dict` replaces those objects, so the wrapper never keeps copies:
it reads and writes through these properties. Before `self.optimizer` is set
(inside `Optimizer.__init__`), they use a scratch space.
"""

from __future__ import annotations

from typing import Any

__all__ = ["InnerOptimizerState"]


class InnerOptimizerState:
    """Mixin (put it before `torch.optim.Optimizer` in the bases): `param_groups` and `state` of `self.optimizer`."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        inner = self.__dict__.get("optimizer")
        return inner.param_groups if inner is not None else self.__dict__.setdefault("_scratch", {})["groups"]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        inner = self.__dict__.get("optimizer")
        if inner is not None:
            inner.param_groups = value
        else:
            self.__dict__.setdefault("_scratch", {})["groups"] = value

    @property
    def state(self) -> Any:
        inner = self.__dict__.get("optimizer")
        return inner.state if inner is not None else self.__dict__.setdefault("_scratch", {})["state"]

    @state.setter
    def state(self, value: Any) -> None:
        inner = self.__dict__.get("optimizer")
        if inner is not None:
            inner.state = value
        else:
            self.__dict__.setdefault("_scratch", {})["state"] = value
