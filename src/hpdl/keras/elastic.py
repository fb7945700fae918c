"""`hvd.elastic` for Keras 3: `KerasState` and the callbacks that commit it and count batches and epochs.

Horovod's `horovod.tensorflow.keras.elastic` on a fixed world (see
`hpdl.horovod.elastic` for what elastic means in hpdl). `KerasState` works on
Keras variables, not TensorFlow ones, so it runs on the torch backend too
and importing it does not import TensorFlow: it saves with NumPy, restores
with `assign` and syncs with the eager broadcast the callbacks use.
"""

from __future__ import annotations

from typing import Any, Optional

import keras
import numpy as np

from hpdl.horovod.elastic import ObjectState, State, run
from hpdl.keras import collectives

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run", "State"]


class KerasState(ObjectState):
    """A Keras model's and optimizer's variables, plus picklable attributes (`batch=`, `epoch=`).

    `sync()` takes rank 0's values, `commit()` saves a restore point and
    `restore()` returns to it. The optimizer may also be the model's own.
    """

    model: Any
    optimizer: Any
    _saved_values: list[np.ndarray]

    def __init__(self, model: keras.Model, optimizer: Optional[keras.optimizers.Optimizer] = None, **kwargs: Any):
        collectives.backend()
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer if optimizer is not None else getattr(model, "optimizer", None))
        super().__init__(**kwargs)
        self._save_variables()

    def _tracked(self) -> list[Any]:
        variables = list(self.model.variables)
        if self.optimizer is not None:
            variables += list(self.optimizer.variables)
        return variables

    def _save_variables(self) -> None:
        values = [np.array(keras.ops.convert_to_numpy(v.value)) for v in self._tracked()]
        object.__setattr__(self, "_saved_values", values)

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        tracked = self._tracked()
        if len(tracked) != len(self._saved_values):
            raise RuntimeError(
                f"KerasState.restore: {len(tracked)} variables now, {len(self._saved_values)} at the last commit "
                "(the optimizer was built since): build the optimizer before creating the state, or commit() first"
            )
        for v, value in zip(tracked, self._saved_values):
            v.assign(value)
        super().restore()

    def sync(self) -> None:
        tracked = self._tracked()
        if tracked:
            collectives.broadcast_variables(tracked, root_rank=0, name="elastic.KerasState")
        self._save_variables()
        super().sync()


class CommitStateCallback(keras.callbacks.Callback):
    """Commit `state` every `batches_per_commit` batches and at the end of each epoch."""

    def __init__(self, state: State, batches_per_commit: int = 1):
        super().__init__()
        if not isinstance(batches_per_commit, int) or batches_per_commit < 1:
            raise ValueError(f"batches_per_commit={batches_per_commit!r} must be a positive int")
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.batches_remaining = self.batches_per_commit  # the same count on every rank after a reset

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep `state.batch` at the batch just finished (0 after an epoch); as Horovod, `params["steps"]` drops by it."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self.steps_per_epoch: Optional[int] = None

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.steps_per_epoch = None

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        if self.params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = self.params["steps"]
            self.params["steps"] = self.steps_per_epoch - self.state.batch  # type: ignore[attr-defined]

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self.state.batch = batch  # type: ignore[attr-defined]

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.state.batch = 0  # type: ignore[attr-defined]


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep `state.epoch` at the number of epochs done, counted across resets (Keras restarts at 0)."""

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self.initial_epoch: int = state.epoch  # type: ignore[attr-defined]

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.initial_epoch = self.state.epoch  # type: ignore[attr-defined]

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.state.epoch = self.initial_epoch + epoch + 1  # type: ignore[attr-defined]
