"""Horovod's TensorFlow helpers for model state: broadcast_variables, broadcast_object, allgather_object.

Objects travel through `hpdl.horovod.functions` (pickled bytes, named operations of the same engine), so they
need no TensorFlow op and work the same eagerly and between `tf.function` calls.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from hpdl.horovod import functions as hfunctions
from hpdl.horovod.process_sets import ProcessSet, global_process_set
from hpdl.tensorflow import bridge, ops

__all__ = ["broadcast_variables", "broadcast_object", "broadcast_object_fn", "allgather_object"]


def broadcast_variables(
    variables: Sequence[tf.Variable], root_rank: int, process_set: ProcessSet = global_process_set,
    inplace: bool = False,
) -> Any:  # fmt: skip
    """Copy `root_rank`'s values into `variables` on every rank of the set (one operation for the whole list).

    Returns None eagerly, and a grouped assign op inside `tf.function` (as Horovod). `inplace` is accepted for
    Horovod's signature: the values are assigned into the same variables either way.
    """
    variables = [ops.tf_variable(v, "broadcast_variables") for v in variables]
    if not variables:
        return None
    values = ops.broadcast_(variables, root_rank, name=None, process_set=process_set)
    return None if tf.executing_eagerly() else tf.group(*values)


def broadcast_object(
    obj: Any, root_rank: int = 0, session: Any = None, name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> Any:  # fmt: skip
    """Any picklable object from `root_rank` on every rank of the set. `session` (TF1) is not supported."""
    _no_session(session, "broadcast_object")
    with bridge.tf_errors():
        return hfunctions.broadcast_object(obj, root_rank, name=name, process_set=process_set)


def broadcast_object_fn(
    root_rank: int = 0, session: Any = None, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> Callable[[Any], Any]:
    """Horovod's TF1 form (a function that broadcasts its argument), here without a session."""
    _no_session(session, "broadcast_object_fn")

    def bcast(obj: Any) -> Any:
        return broadcast_object(obj, root_rank, name=name, process_set=process_set)

    return bcast


def allgather_object(
    obj: Any, session: Any = None, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> list:
    """Every rank's picklable object, in a list ordered by rank within the set."""
    _no_session(session, "allgather_object")
    with bridge.tf_errors():
        return hfunctions.allgather_object(obj, name=name, process_set=process_set)


def _no_session(session: Any, what: str) -> None:
    if session is not None:
        raise NotImplementedError(f"{what}(session=...) is TensorFlow 1's graph mode; call it eagerly (TF2)")
