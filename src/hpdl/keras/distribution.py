"""Keras' own data parallelism (`keras.distribution.DataParallel`) over hpdl's "hpdl" torch process group.

Keras' torch backend calls `init_process_group("nccl"/"gloo")` unless a
group already exists; opening the "hpdl" group first puts its collectives
on hpdl's MPI and shared memory. Keras 3.15.1's torch backend has no
`distribution_lib` at all (torch data parallel landed after it, keras#23418):
there `keras.distribution.list_devices()` fails with an AttributeError on
None, so this function says so instead, and `DistributedOptimizer` is the
way to train data parallel on that version.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import keras

from hpdl.keras import collectives

__all__ = ["keras_data_parallel", "NO_TORCH_DISTRIBUTION"]

NO_TORCH_DISTRIBUTION = (
    "keras.distribution.DataParallel does not run on the torch backend of Keras {version}: its torch backend has no "
    "distribution_lib (torch data parallel came with keras#23418, after this version). Use "
    "hpdl.keras.DistributedOptimizer, or a Keras release that has it"
)


def keras_data_parallel(devices: Optional[Sequence[str]] = None) -> Any:
    """Open the "hpdl" process group (unless one exists) and set Keras' `DataParallel` distribution over it."""
    name = collectives.backend()
    if name != "torch":
        raise NotImplementedError(
            "keras_data_parallel runs Keras' distribution on the torch backend; Keras' TensorFlow distribution is "
            "a prototype (its docstring: 'DO NOT USE'). Use hpdl.keras.DistributedOptimizer on TensorFlow"
        )
    from keras.src import backend as keras_backend

    if getattr(keras_backend, "distribution_lib", None) is None:
        raise NotImplementedError(NO_TORCH_DISTRIBUTION.format(version=keras.__version__))
    import torch.distributed as dist

    import hpdl

    world = hpdl.init()
    if not dist.is_initialized():
        dist.init_process_group("hpdl", rank=world.rank, world_size=world.size)
    distribution = keras.distribution.DataParallel(devices=list(devices) if devices is not None else None)
    keras.distribution.set_distribution(distribution)
    return distribution
