"""Horovod's Keras API on Keras 3: `import hpdl.keras as hvd` in place of `import horovod.tensorflow.keras as hvd`.

    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(x_shard, y_shard, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                           hvd.callbacks.MetricAverageCallback()])

Runs on the torch and TensorFlow Keras backends (KERAS_BACKEND). Importing
this package imports Keras (and, on the TensorFlow backend, TensorFlow);
nothing else in hpdl does. docs/keras.md lists what differs from Horovod.
"""

from __future__ import annotations

from typing import Any, Optional

import keras

from hpdl import horovod as _hvd
from hpdl.horovod import (
    Adasum,
    Average,
    HorovodInternalError,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather_object,
    broadcast_object,
    cross_rank,
    cross_size,
    global_process_set,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    shutdown,
    size,
)
from hpdl.keras import callbacks, elastic
from hpdl.keras.compression import Compression, Compressor
from hpdl.keras.distribution import keras_data_parallel
from hpdl.keras.functions import (
    allgather,
    allreduce,
    broadcast,
    broadcast_global_variables,
    broadcast_variables,
    load_model,
)
from hpdl.keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from hpdl.keras.pipeline import PipelineModel


def init(comm: Any = None, process_sets: Optional[Any] = None) -> None:
    """`hpdl.horovod.init`; on the TensorFlow backend `hpdl.tensorflow.init`, which also sizes TensorFlow's thread
    pools to this rank's share of the cores unless the user chose."""
    if keras.backend.backend() == "tensorflow":
        from hpdl import tensorflow as hvd_tensorflow

        hvd_tensorflow.init(comm=comm, process_sets=process_sets)
    else:
        _hvd.init(comm=comm, process_sets=process_sets)


__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "size",
    "rank",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_homogeneous",
    "mpi_built",
    "mpi_enabled",
    "nccl_built",
    "mpi_threads_supported",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "HorovodInternalError",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "allreduce",
    "allgather",
    "broadcast",
    "broadcast_variables",
    "broadcast_global_variables",
    "broadcast_object",
    "allgather_object",
    "load_model",
    "callbacks",
    "elastic",
    "keras_data_parallel",
    "PipelineModel",
]
