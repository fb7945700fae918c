"""`hvd.elastic` for TensorFlow on a fixed world: `run`, `ObjectState`, `TensorFlowState`, `TensorFlowKerasState`.

The discipline of `hpdl.horovod.elastic` (sync at the start, commit restore points, restore and rerun after a
HorovodInternalError) with TensorFlow variables as the state. Errors raised inside a `tf.function` reach Python
as TensorFlow's UnknownError and are not retried: call the step eagerly under `run`, or let the job fail.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import tensorflow as tf

from hpdl.horovod.elastic import ObjectState, State, run
from hpdl.tensorflow.ops import tf_variable

__all__ = ["run", "State", "ObjectState", "TensorFlowState", "TensorFlowKerasState"]


class TensorFlowState(ObjectState):
    """Variables (and picklable attributes) kept in step: `sync` takes rank 0's, `restore` the last commit."""

    _variables: list[tf.Variable]
    _saved_values: list[Any]

    def __init__(self, variables: Optional[Sequence[tf.Variable]] = None, **kwargs: Any):
        object.__setattr__(self, "_variables", list(variables) if variables is not None else [])
        super().__init__(**kwargs)
        self._save_variables()

    def _tracked(self) -> list[tf.Variable]:
        return list(self._variables)

    def _save_variables(self) -> None:
        object.__setattr__(self, "_saved_values", [v.numpy().copy() for v in self._tracked()])

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        for v, value in zip(self._tracked(), self._saved_values):
            v.assign(value)
        super().restore()

    def sync(self) -> None:
        from hpdl.tensorflow.functions import broadcast_variables

        if self._tracked():
            broadcast_variables(self._tracked(), root_rank=0)
        self._save_variables()
        super().sync()


class TensorFlowKerasState(TensorFlowState):
    """A Keras model's (and optimizer's) variables, plus picklable attributes."""

    model: Any
    optimizer: Any

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any):
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        super().__init__(None, **kwargs)

    def _tracked(self) -> list[tf.Variable]:
        variables = list(self.model.variables)
        if self.optimizer is not None:
            variables += list(self.optimizer.variables)
        return [tf_variable(v, "TensorFlowKerasState") for v in variables]
