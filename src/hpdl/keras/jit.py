"""Keep XLA away from a train step that holds hpdl's collectives.

On TensorFlow the gradients are reduced through a `tf.numpy_function`, which
XLA cannot compile. Keras resolves `jit_compile="auto"` to XLA on a GPU
when every layer supports it, without asking the optimizer, so a model
compiled with a DistributedOptimizer would fail at its first step. The
guard, installed on Keras' Trainer once a DistributedOptimizer exists,
resolves "auto" to the non-XLA path for such models and refuses an
explicit `jit_compile=True` at `compile()` with what to do instead. Models
compiled with any other optimizer are untouched. (On torch, "auto" already
means eager and `jit_compile=True` is `torch.compile`, left as Keras has it.)
"""

from __future__ import annotations

from typing import Any, Callable

import keras

__all__ = ["install", "XLA_REFUSED"]

XLA_REFUSED = (
    "jit_compile=True with hpdl.keras.DistributedOptimizer on the TensorFlow backend: XLA cannot compile the "
    "gradient allreduce (a tf.numpy_function). Compile with jit_compile=False or 'auto' (hpdl then runs the step as a "
    "tf.function without XLA), or use the torch backend"
)

_installed = False


def install(is_distributed: Callable[[Any], bool]) -> None:
    """`is_distributed(optimizer)`: whether a model's optimizer holds hpdl's collectives."""
    global _installed
    if _installed:
        return
    from keras.src.trainers import trainer as trainer_module

    trainer = trainer_module.Trainer
    resolve = trainer._resolve_auto_jit_compile
    prop = trainer.__dict__["jit_compile"]

    def _resolve_auto_jit_compile(self: Any) -> bool:
        if _guarded(self, is_distributed):
            return False
        return bool(resolve(self))

    def _set_jit_compile(self: Any, value: Any) -> None:
        if value and _guarded(self, is_distributed):
            raise ValueError(XLA_REFUSED)
        prop.fset(self, value)

    trainer._resolve_auto_jit_compile = _resolve_auto_jit_compile
    trainer.jit_compile = property(prop.fget, _set_jit_compile)
    _installed = True


def _guarded(model: Any, is_distributed: Any) -> bool:
    return keras.backend.backend() == "tensorflow" and is_distributed(getattr(model, "optimizer", None))
