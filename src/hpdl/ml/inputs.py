"""`make_shards`: an estimator's input, validated where it lives, as `Shards` (one array, a rank's shard, or Dask).

It sits above `base` (the `Shards` kinds) and `dask_backend` (which builds
on `base`), so that neither of those imports the other.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from hpdl.ml import device
from hpdl.ml.base import (
    LocalShards,
    Shards,
    SpmdShards,
    agree_on_layout,
    is_dask_array,
    numpy_dtype,
    validate_block,
)
from hpdl.ml.dask_backend import DaskShards

__all__ = ["make_shards"]


def make_shards(
    X: Any,
    extra: Sequence[Any],
    *,
    comm: Any,
    dtype: Any,
    estimator: str,
    extra_checks: Optional[Callable[[np.ndarray, list], list]] = None,
    on_device: bool = False,
) -> Shards:
    """Validate the input where it lives and wrap it: Dask array, rank's shard (comm), or one array.

    `extra` are row-aligned companions of X (sample weights, targets) or
    None; `extra_checks(X, extra)` validates them against the checked X and
    returns them as arrays (it runs on the rank, so its error is shared).
    A device array (CuPy through DLPack, a torch tensor on a GPU) is
    validated on its device and stays there when the estimator computes
    `on_device`; its companions are checked and kept on the host. Other
    estimators, and CPU tensors, get a host copy (a view of a CPU tensor's
    memory), companions included, as scikit-learn's `check_array` would.
    """
    if device.is_device_array(X) and not (on_device and device.stays_on_device(X)):
        # a host copy, as check_array makes (a view of a CPU tensor's memory), companions too
        X = device.host(device.as_tensor(X))
        extra = [device.host(device.as_tensor(e)) if device.is_device_array(e) else e for e in extra]
    if is_dask_array(X):
        return DaskShards.build(X, extra, dtype=dtype, estimator=estimator)
    distributed = comm is not None and comm.size > 1
    if not distributed:
        Xv, parts = _checked(X, extra, dtype, False, estimator, extra_checks)
        return LocalShards((Xv, *parts))
    try:
        Xv, parts = _checked(X, extra, dtype, True, estimator, extra_checks)
        outcome: Any = Xv
    except (ValueError, TypeError) as exc:
        outcome = exc
    sizes = agree_on_layout(comm, outcome, estimator)
    return SpmdShards((Xv, *parts), comm, sizes)


def _checked(
    X: Any,
    extra: Sequence[Any],
    dtype: Any,
    allow_empty: bool,
    estimator: str,
    extra_checks: Optional[Callable[[np.ndarray, list], list]],
) -> tuple[Any, list]:
    """X validated where it lives, and its companions checked against it (on the host)."""
    if not device.is_device_array(X):
        Xv = validate_block(X, dtype=dtype, allow_empty=allow_empty, estimator=estimator)
        return Xv, extra_checks(Xv, list(extra)) if extra_checks else list(extra)
    Xt = device.validate(X, dtype=dtype, allow_empty=allow_empty, estimator=estimator)
    # the companions' checks read X's shape and dtype only: a stand-in of no memory takes its place
    stand_in = np.broadcast_to(np.zeros((), numpy_dtype(Xt.dtype)), tuple(Xt.shape))
    companions = [device.host(e) if device.is_device_array(e) else e for e in extra]
    return Xt, extra_checks(stand_in, companions) if extra_checks else companions
