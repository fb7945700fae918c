"""What every hpdl estimator shares with scikit-learn: parameters, validation, the data-location switch."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
from sklearn.utils.validation import _check_sample_weight, check_is_fitted

from hpdl.ml import device
from hpdl.ml.base import Shards, is_dask_array, validate_block
from hpdl.ml.inputs import make_shards

__all__ = ["DistributedMixin", "weights_check", "check_weights"]


def check_weights(sample_weight: Any, X: np.ndarray, dtype: Any = None) -> np.ndarray:
    """scikit-learn's sample-weight checks; an empty shard gets an empty weight vector."""
    if X.shape[0] > 0:
        return _check_sample_weight(sample_weight, X, dtype=dtype or X.dtype)
    sw = np.asarray(sample_weight, dtype=dtype or X.dtype)
    if sw.ndim > 1 or (sw.ndim == 1 and sw.shape[0] != 0):
        raise ValueError(f"sample_weight.shape == {sw.shape}, expected (0,)!")
    return sw.reshape(0)


def weights_check(sample_weight_pos: int = 0) -> Callable[[np.ndarray, list], list]:
    """Companion check: extra[pos] is sample_weight (None stays None), validated like scikit-learn's."""

    def check(X: np.ndarray, extra: list) -> list:
        out = list(extra)
        sw = out[sample_weight_pos]
        if sw is not None:
            out[sample_weight_pos] = check_weights(sw, X)
        return out

    return check


class DistributedMixin:
    """`comm` (an hpdl Communicator, or None) and the switch between one array, SPMD shards and Dask."""

    comm: Any
    _on_device = False
    """True where the estimator computes on a device array's own device (hpdl.ml.device); the others copy it to
    the host first."""

    def _shards(
        self,
        X: Any,
        extra: Sequence[Any] = (),
        *,
        dtype: Any = (np.float64, np.float32),
        check: Optional[Callable[[np.ndarray, list], list]] = None,
    ) -> Shards:
        shards = make_shards(
            X,
            list(extra),
            comm=self.comm,
            dtype=list(dtype),
            estimator=type(self).__name__,
            extra_checks=check,
            on_device=self._on_device,
        )
        self.n_features_in_ = shards.n_features
        if not shards.distributed:
            names = getattr(X, "columns", None)
            if names is not None and all(isinstance(c, str) for c in names):
                self.feature_names_in_ = np.asarray(names, dtype=object)
        return shards

    def _check_fitted(self, attribute: str) -> None:
        check_is_fitted(self, attribute)

    def _check_predict_input(self, X: Any, dtype: Any) -> Any:
        """Validated rows for predict/transform: a Dask array stays lazy, an empty shard is allowed."""
        name = type(self).__name__
        if is_dask_array(X):
            if X.ndim != 2 or X.shape[1] != self.n_features_in_:
                raise ValueError(
                    f"X has {X.shape[-1]} features, but {name} is expecting {self.n_features_in_} features as input."
                )
            return X
        allow_empty = self.comm is not None and self.comm.size > 1
        Xv: Any
        if device.is_device_array(X) and not (self._on_device and device.stays_on_device(X)):
            X = device.host(device.as_tensor(X))
        if device.is_device_array(X):
            Xv = device.validate(X, dtype=[dtype], allow_empty=allow_empty, estimator=name)
        else:
            Xv = validate_block(X, dtype=dtype, allow_empty=allow_empty, estimator=name)
        if Xv.shape[1] != self.n_features_in_:
            raise ValueError(
                f"X has {Xv.shape[1]} features, but {name} is expecting {self.n_features_in_} features as input."
            )
        return Xv
