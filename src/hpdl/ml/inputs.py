"""`make_shards`: an estimator's input, validated where it lives, as `Shards` (one array, a rank's shard, or Dask).

It sits above `base` (the `Shards` kinds) and `dask_backend` (which builds
on `base`), so that neither of those imports the other.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from hpdl.ml.base import LocalShards, Shards, SpmdShards, agree_on_layout, is_dask_array, validate_block
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
) -> Shards:
    """Validate the input where it lives and wrap it: Dask array, rank's shard (comm), or one array.

    `extra` are row-aligned companions of X (sample weights, targets) or
    None; `extra_checks(X, extra)` validates them against the checked X and
    returns them as arrays (it runs on the rank, so its error is shared).
    """
    if is_dask_array(X):
        return DaskShards.build(X, extra, dtype=dtype, estimator=estimator)
    distributed = comm is not None and comm.size > 1
    if not distributed:
        Xv = validate_block(X, dtype=dtype, allow_empty=False, estimator=estimator)
        parts = extra_checks(Xv, list(extra)) if extra_checks else list(extra)
        return LocalShards((Xv, *parts))
    try:
        Xv = validate_block(X, dtype=dtype, allow_empty=True, estimator=estimator)
        parts = extra_checks(Xv, list(extra)) if extra_checks else list(extra)
        outcome: Any = Xv
    except (ValueError, TypeError) as exc:
        outcome = exc
    sizes = agree_on_layout(comm, outcome, estimator)
    return SpmdShards((Xv, *parts), comm, sizes)
