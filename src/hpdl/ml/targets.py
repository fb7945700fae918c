"""Class labels of a classifier's target, found over every rank's rows (or a Dask array's blocks)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import assert_all_finite, column_or_1d

from hpdl.ml.base import ShardMismatchError, is_dask_array

__all__ = ["global_classes"]


def _local_classes(y: Any) -> np.ndarray:
    """scikit-learn's checks on y (a continuous target raises "Unknown label type"), then its sorted labels."""
    if y is None:
        raise ValueError("requires y to be passed, but the target y is None")
    y = np.asarray(y)
    if y.size:
        if y.dtype.kind in "fc":  # as scikit-learn's own classifiers do first: not NaN cast to int, with a warning
            assert_all_finite(y, input_name="y")
        check_classification_targets(y)
    return np.unique(column_or_1d(y, warn=True)) if y.ndim == 2 else np.unique(y.ravel())


def global_classes(y: Any, comm: Optional[Any]) -> np.ndarray:
    """The sorted union of the labels of every rank's y; an invalid y on any rank raises on every rank."""
    if is_dask_array(y):
        import dask.array as da

        return np.unique(da.unique(y).compute())
    if comm is None or comm.size == 1:
        return _local_classes(y)
    try:
        mine: Any = _local_classes(y)
        failure = ""
    except (ValueError, TypeError) as exc:
        mine, failure = None, f"{type(exc).__name__}: {exc}"
        error: Optional[BaseException] = exc
    else:
        error = None
    table = comm.allgather_object((mine, failure))
    failed = [r for r, (_, f) in enumerate(table) if f]
    if failed:
        if error is not None:
            raise error
        detail = "; ".join(f"rank {r}: {table[r][1]}" for r in failed)
        raise ShardMismatchError(f"the target was rejected on rank(s) {failed}: {detail}")
    labels = [c for c, _ in table if c is not None and len(c)]
    return np.unique(np.concatenate(labels)) if labels else np.zeros(0)
