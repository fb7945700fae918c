"""A Keras model as a pipeline over ranks (HyPar-Flow's model parallelism), with data parallelism beside it.

On the torch backend every Keras layer is a `torch.nn.Module` whose weights
are `nn.Parameter`s, so hpdl's `Pipeline` carries the model's layers as
they are: micro-batches, GPipe or 1F1B, activations and their gradients
between stages over hpdl's point-to-point links, and `data_parallel=` for
dp x pp. Each stage then applies its gradients with a Keras optimizer.

On TensorFlow, Keras layers are not modules autograd can cut between
processes: a stage would have to keep each micro-batch's GradientTape
open until the next stage sends the gradient of its input. That is a
pipeline engine of its own (not built here); `PipelineModel` refuses the
TensorFlow backend and says to use torch.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import keras
import torch

from hpdl.comm.base import Communicator
from hpdl.parallel.pipe import Pipeline

__all__ = ["PipelineModel", "chain_layers"]


class PipelineModel:
    """This rank's stage of a Keras `Sequential` (or chain-shaped functional) model.

        pipe = hvd.PipelineModel(model, pp_comm, chunks=4, schedule="1f1b", data_parallel=dp_comm)
        pipe.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
        loss = pipe.train_on_batch(x, y)        # x read on the first stage, y on the last; loss on every rank

    Every rank builds the same model (same seed, or weights loaded), and
    keeps only its stage's layers in use. Layers run with Keras' default
    `training` (inference behaviour for Dropout and BatchNormalization).
    """

    def __init__(
        self,
        model: keras.Model,
        comm: Communicator,
        *,
        chunks: int = 4,
        schedule: str = "1f1b",
        balance: Union[None, str, Sequence[int]] = None,
        checkpoint: str = "never",
        sample: Any = None,
        data_parallel: Optional[Communicator] = None,
    ):
        if keras.backend.backend() != "torch":
            raise NotImplementedError(
                f"PipelineModel runs on the torch Keras backend (its layers are torch modules); this is "
                f"{keras.backend.backend()!r}: set KERAS_BACKEND=torch"
            )
        layers = chain_layers(model)
        self.pipeline = Pipeline(
            layers, comm, chunks=chunks, schedule=schedule, balance=balance, checkpoint=checkpoint,
            sample=None if sample is None else _tensor(sample), data_parallel=data_parallel,
        )  # fmt: skip
        self.layers: list[keras.layers.Layer] = list(self.pipeline.layers)
        """This stage's Keras layers."""
        self.trainable_variables = [v for layer in self.layers for v in layer.trainable_variables]
        self.optimizer: Optional[keras.optimizers.Optimizer] = None
        self.loss: Any = None

    def compile(self, optimizer: Any, loss: Any) -> None:
        """The stage's optimizer (a fresh one per stage: it sees only this stage's weights) and the loss."""
        self.optimizer = keras.optimizers.get(optimizer)
        self.optimizer.build(self.trainable_variables)
        self.loss = keras.losses.get(loss)

    def train_on_batch(self, x: Any, y: Any) -> float:
        """Forward and backward of every micro-batch, then this stage's update; the batch's mean loss."""
        if self.optimizer is None:
            raise RuntimeError("PipelineModel.train_on_batch before compile(optimizer=..., loss=...)")
        self._zero_grad()
        loss_fn = self.loss
        mean = self.pipeline.step(
            None if x is None else _tensor(x), None if y is None else _tensor(y),
            (lambda out, target: loss_fn(target, out)) if self.pipeline.is_last else None,
        )  # fmt: skip
        grads = [
            v.value.grad if v.value.grad is not None else torch.zeros_like(v.value) for v in self.trainable_variables
        ]
        with torch.no_grad():
            self.optimizer.apply(grads, self.trainable_variables)
        return float(mean)

    def gradients(self, x: Any, y: Any) -> list[Any]:
        """This stage's gradients of the batch's mean loss (nothing applied): for checks against one process."""
        self._zero_grad()
        loss_fn = self.loss
        self.pipeline.step(
            None if x is None else _tensor(x), None if y is None else _tensor(y),
            (lambda out, target: loss_fn(target, out)) if self.pipeline.is_last else None,
        )  # fmt: skip
        return [v.value.grad.clone() for v in self.trainable_variables]

    def _zero_grad(self) -> None:
        """Zeroed in place, not set to None: a data-parallel stage's reducer may hold the gradients' storage."""
        for v in self.trainable_variables:
            if v.value.grad is not None:
                v.value.grad.zero_()

    def predict(self, x: Any) -> Any:
        """The model's output on the last stage (None on the others)."""
        return self.pipeline.predict(None if x is None else _tensor(x))

    def get_weights(self) -> list[Any]:
        """This stage's weights as NumPy arrays, in layer order."""
        return [w for layer in self.layers for w in layer.get_weights()]

    def close(self) -> None:
        self.pipeline.close()

    def __enter__(self) -> PipelineModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def chain_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The model's layers in order, when each layer feeds only the next (Sequential, or a functional chain)."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"PipelineModel splits a keras.Model, got {type(model).__name__}")
    if not model.built:
        raise ValueError("build the model first (give it an Input, or call it once) so that every rank holds weights")
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    if not layers:
        raise ValueError("the model has no layers to split")
    if not isinstance(model, keras.Sequential):
        previous = model.inputs
        for layer in layers:
            try:
                inputs, outputs = layer.input, layer.output
            except (AttributeError, ValueError) as exc:
                raise ValueError(f"layer {layer.name!r} is used more than once: {exc}") from None
            if keras.tree.flatten(inputs) != keras.tree.flatten(previous):
                raise ValueError(
                    f"PipelineModel needs a chain of layers (each feeding only the next); {layer.name!r} takes "
                    "other inputs: write the branches as one layer (a keras.Model used as a layer is one stage unit)"
                )
            previous = outputs
    return layers


def _tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else keras.ops.convert_to_tensor(value)
