"""Horovod's TensorFlow 2 API on hpdl: `import hpdl.tensorflow as hvd` in place of `import horovod.tensorflow as hvd`.

    hvd.init()
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    hvd.broadcast_variables(model.variables, root_rank=0)   # after the first step

The collectives are those of `hpdl.horovod` (the same engine, matched by name and checked on every rank),
reached from TensorFlow through `hpdl.tensorflow.bridge`: eagerly, and inside `tf.function` as graph nodes
(not under XLA). See docs/keras.md.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from hpdl import horovod as _hvd
from hpdl.horovod.basics import (
    Adasum,
    Average,
    HostsUpdatedInterrupt,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    size,
)
from hpdl.horovod.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from hpdl.horovod.timeline import start_timeline, stop_timeline
from hpdl.tensorflow import elastic, threads, util
from hpdl.tensorflow.bridge import HorovodInternalError
from hpdl.tensorflow.compression import Compression, Compressor
from hpdl.tensorflow.functions import allgather_object, broadcast_object, broadcast_object_fn, broadcast_variables
from hpdl.tensorflow.ops import (
    _allreduce,
    _grouped_allreduce,
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    reducescatter,
    size_op,
)
from hpdl.tensorflow.tape import DistributedGradientTape, PartialDistributedGradientTape, allreduce_gradients
from hpdl.tensorflow.util import _executing_eagerly


def _not_for_autograph() -> None:
    """hpdl.tensorflow runs as written inside tf.function (as TensorFlow and Keras do): AutoGraph, which rewrites
    user code, once turned a tape's `gradient` into another method of the same class."""
    try:
        from tensorflow.python.autograph.core import config

        if not any(getattr(rule, "_prefix", None) == "hpdl.tensorflow" for rule in config.CONVERSION_RULES):
            config.CONVERSION_RULES = (config.DoNotConvert("hpdl.tensorflow"), *config.CONVERSION_RULES)
    except (ImportError, AttributeError):  # (a TensorFlow that moved it: AutoGraph then converts hpdl too)
        pass


_not_for_autograph()

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
    "rank_op",
    "local_rank_op",
    "size_op",
    "local_size_op",
    "process_set_included_op",
    "mpi_built",
    "mpi_enabled",
    "gloo_built",
    "gloo_enabled",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "mpi_threads_supported",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Compression",
    "Compressor",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "grouped_allgather",
    "broadcast",
    "broadcast_",
    "alltoall",
    "reducescatter",
    "grouped_reducescatter",
    "join",
    "barrier",
    "broadcast_variables",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "allgather_object",
    "allreduce_gradients",
    "DistributedGradientTape",
    "PartialDistributedGradientTape",
    "DistributedOptimizer",
    "SyncBatchNormalization",
    "start_timeline",
    "stop_timeline",
    "check_num_rank_power_of_2",
    "util",
    "elastic",
    "_executing_eagerly",
    "_allreduce",
    "_grouped_allreduce",
]


def __getattr__(name: str) -> Any:
    """`SyncBatchNormalization` is a Keras layer: Keras is imported when it is first asked for, not with hpdl."""
    if name == "SyncBatchNormalization":
        from hpdl.tensorflow.sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def init(comm: Any = None, process_sets: Optional[Any] = None) -> None:
    """Start hpdl (the backend comes from the launcher) and the Horovod state on it (`hpdl.horovod.init`), and
    size TensorFlow's thread pools to this rank's share of the cores unless the user chose (`threads`)."""
    _hvd.init(comm=comm, process_sets=process_sets)
    threads.share_cores(_hvd.local_size())


def shutdown() -> None:
    _hvd.shutdown()


def is_initialized() -> bool:
    return _hvd.is_initialized()


def check_num_rank_power_of_2(num_rank: int) -> bool:
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def broadcast_global_variables(root_rank: int) -> Any:
    """TensorFlow 1's global variables do not exist in TF2's eager mode (Horovod raises the same)."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. "
            "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead."
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def DistributedOptimizer(
    optimizer: Any, name: Optional[str] = None, use_locking: bool = False, device_dense: str = "",
    device_sparse: str = "", compression: Any = Compression.none, sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1, op: int = Average, gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False, num_groups: int = 0, groups: Any = None,
    process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True,
) -> Any:  # fmt: skip
    """Horovod hands a Keras optimizer on to its Keras API; hpdl.tensorflow sits below hpdl.keras and does not
    import it: the error says where the wrapper is. TF1's `tf.compat.v1.train.Optimizer` is not supported."""
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise NotImplementedError(
            "hpdl.tensorflow.DistributedOptimizer does not wrap TF1's tf.compat.v1.train.Optimizer; "
            "use a Keras optimizer with hpdl.keras.DistributedOptimizer, or hvd.DistributedGradientTape"
        )
    raise NotImplementedError(
        "Keras optimizers are wrapped by hpdl.keras.DistributedOptimizer: `import hpdl.keras as hvd` "
        "(Horovod's horovod.tensorflow.keras API), or reduce gradients with hvd.DistributedGradientTape"
    )
