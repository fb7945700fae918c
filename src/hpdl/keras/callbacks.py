"""Horovod's Keras callbacks on Keras 3: broadcast, metric averaging, learning-rate warm-up and schedules,
and a best-model checkpoint that rank 0 writes.

Callbacks run eagerly between steps on every backend, so they use the
eager collectives (`hpdl.keras.collectives`), matched by name across ranks.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Union

import keras
import numpy as np

from hpdl.horovod import basics
from hpdl.horovod.process_sets import ProcessSet
from hpdl.keras import collectives

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "BestModelCheckpoint",
]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Start every rank from `root_rank`'s model and optimizer state.

    Horovod broadcasts at the end of the first batch because Keras 2 built
    optimizer slots lazily; here the optimizer is built first and the
    broadcast runs before the first batch, so the first step is already the
    one process's first step. `local_variables` (or `register_local_var`)
    name model variables that keep each rank's own value (Horovod's
    worker-local variables); the optimizer's state is broadcast whole.
    """

    def __init__(
        self,
        root_rank: int = 0,
        device: str = "",
        process_set: Optional[ProcessSet] = None,
        local_variables: Any = None,
    ):
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        self.broadcast_done = False
        self._local_vars: set[int] = set()
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        for var in local_variables:
            self.register_local_var(var)

    def register_local_var(self, var: Any) -> None:
        """Keep `var` (a model variable) out of the broadcast: each rank keeps its own value."""
        if not _is_variable(var):
            raise ValueError(f"local_variables holds variables (model.layers[i].variables), got {type(var).__name__}")
        self._local_vars.add(id(var))

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if self.broadcast_done:
            return
        model = self.model
        optimizer = getattr(model, "optimizer", None)
        # A Keras variable, or on TensorFlow the tf.Variable inside it, names a local one.
        variables = [v for v in model.weights if not {id(v), id(getattr(v, "_value", None))} & self._local_vars]
        if optimizer is not None:
            if not optimizer.built:
                optimizer.build(model.trainable_variables)
            variables += list(optimizer.variables)
        collectives.broadcast_variables(
            variables, self.root_rank, name="BroadcastGlobalVariablesCallback", process_set=self.process_set
        )
        self.broadcast_done = True


def _is_variable(value: Any) -> bool:
    if isinstance(value, keras.Variable):
        return True
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        return isinstance(value, tf.Variable)
    return False


class MetricAverageCallback(keras.callbacks.Callback):
    """Average the epoch's metrics (loss included) over the ranks, so every rank logs and acts on the same numbers.

    Put it before callbacks that read the metrics (checkpoints, early stopping, schedules on a plateau).
    """

    def __init__(self, device: str = "", process_set: Optional[ProcessSet] = None):
        super().__init__()
        self.process_set = process_set

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if _is_number(v))
        if not names:
            return
        values = np.array([float(logs[k]) for k in names], dtype=np.float64)
        # The metric names are part of the operation's name: ranks that log different metrics fail clearly.
        averaged = collectives.allreduce_array(
            values, name="MetricAverageCallback." + ",".join(names), process_set=self.process_set
        )
        for k, v in zip(names, averaged.tolist()):
            logs[k] = v


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return bool(np.ndim(value) == 0)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """lr = initial_lr * multiplier(epoch) from `start_epoch` to `end_epoch` (Horovod's schedule).

    `multiplier`: a number or a function of the (fractional, when not
    `staircase`) epoch. With `staircase=False` the rate changes every batch.
    `momentum_correction` scales SGD's momentum by new_lr / old_lr for the
    batch where the rate changes; Keras 3 keeps momentum as a Python number
    that a traced step reads once, so the correction applies on the torch
    backend and with run_eagerly=True, and is skipped (with a warning) in a
    traced TensorFlow step.
    """

    def __init__(
        self,
        initial_lr: float,
        multiplier: Union[float, Callable[[float], float]],
        start_epoch: int = 0,
        end_epoch: Optional[int] = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: Optional[int] = None,
    ):
        super().__init__()
        if initial_lr is None:
            raise ValueError("initial_lr is required: the learning rate the schedule multiplies")
        self.initial_lr = float(initial_lr)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self._restore_momentum: Optional[float] = None
        self.multiplier: Callable[[float], float] = multiplier if callable(multiplier) else (lambda epoch: multiplier)

    def _active(self, epoch: float) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
        new = self.initial_lr * float(self.multiplier(epoch))
        optimizer.learning_rate = new
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and isinstance(momentum, float) and momentum and old > 0 and new != old:
            if self._momentum_takes_effect():
                self._restore_momentum = momentum
                optimizer.momentum = momentum * new / old

    def _momentum_takes_effect(self) -> bool:
        if keras.backend.backend() == "torch" or self.model.run_eagerly:
            return True
        warnings.warn(
            "momentum_correction is skipped: in a traced TensorFlow step Keras 3 reads SGD's momentum once "
            "(pass momentum_correction=False, or run_eagerly=True)",
            stacklevel=3,
        )
        self.momentum_correction = False
        return False

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        if self.steps_per_epoch is None and not self.staircase:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ValueError(
                    "LearningRateScheduleCallback with staircase=False needs steps_per_epoch= (Keras gave no "
                    "number of steps, as with a generator)"
                )
            self.steps_per_epoch = int(steps)

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.current_epoch = epoch
        if self.staircase and self._active(epoch):
            self._adjust(epoch)

    def on_train_batch_begin(self, batch: int, logs: Optional[dict] = None) -> None:
        if self.staircase:
            return
        assert self.steps_per_epoch is not None
        epoch = self.current_epoch + float(batch) / self.steps_per_epoch
        if self._active(epoch):
            self._adjust(epoch)

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        if self._restore_momentum is not None:
            self.model.optimizer.momentum = self._restore_momentum
            self._restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the rate from initial_lr / size to initial_lr over `warmup_epochs`, batch by batch (Goyal et al.)."""

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: Optional[int] = None,
        verbose: int = 0,
    ):
        size = basics.size()

        def multiplier(epoch: float) -> float:
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
            momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch,
        )  # fmt: skip
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        if epoch == self.warmup_epochs - 1:
            self.model.optimizer.learning_rate = self.initial_lr  # the ramp's end, exactly
            if self.verbose and basics.rank() == 0:
                print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {self.initial_lr:g}.")
        super().on_epoch_end(epoch, logs)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Save the model when `monitor` improves; rank 0 writes, every rank keeps the same `best`.

    Horovod's Spark estimator filled in the path; here pass `filepath=`
    (`.keras`, or `.weights.h5` with `save_weights_only=True`). Average the
    monitored metric first (MetricAverageCallback before this one) so that
    ranks agree on what improved.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        mode: str = "auto",
        save_freq: Union[str, int] = "epoch",
        *,
        filepath: Optional[str] = None,
        save_weights_only: bool = False,
    ):
        if filepath is None:
            raise ValueError("BestModelCheckpoint needs filepath= (a .keras file, or .weights.h5 with weights only)")
        super().__init__(
            filepath, monitor=monitor, verbose=verbose if basics.rank() == 0 else 0, save_best_only=True, mode=mode,
            save_freq=save_freq, save_weights_only=save_weights_only,
        )  # fmt: skip

    def _save_model(self, epoch: int, batch: Optional[int], logs: Optional[dict]) -> None:
        if basics.rank() == 0:
            super()._save_model(epoch, batch, logs)
        else:  # the same decision as rank 0, so `best` stays in step; nothing written
            self._should_save_model(epoch, batch, logs, self._get_file_path(epoch, batch, logs))
