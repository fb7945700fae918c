"""Brute-force nearest neighbours over sharded data, with scikit-learn's API.

The fitted data stays where it is (one array, each rank's shard, or the
blocks of a Dask array). A query is answered by every block: distances by
matrix products, the block's k best by `topk`, indices shifted by the
block's global offset; the candidates of all blocks are merged into the k
best overall (between blocks, ties go to the smaller global index; inside a
block, as in scikit-learn, which of two tied rows is kept is not specified). With `comm`, each rank
asks about its own query rows: the ranks share the queries (one allgather),
each searches its shard for all of them, the candidates are gathered, and
each rank keeps the merged answer for its own rows. Labels and targets
travel with the candidates, so a classifier never gathers y.
"""

from __future__ import annotations

from numbers import Integral
from typing import Any, Optional

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin, MultiOutputMixin, RegressorMixin
from sklearn.metrics import r2_score
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.validation import _check_sample_weight, check_array, check_consistent_length

from hpdl.ml import device, kernels
from hpdl.ml.base import Shards, agree_on_layout, is_dask_array
from hpdl.ml.estimator import DistributedMixin
from hpdl.ml.targets import global_classes

__all__ = ["NearestNeighbors", "KNeighborsClassifier", "KNeighborsRegressor"]

METRICS = ("euclidean", "cosine")


def _index_block(block: tuple, meta: Any) -> tuple:
    X = block[0]
    return (X, kernels.row_sq_norms(X), *block[1:])


def _search(block: tuple, meta: Any, queries: np.ndarray, k: int, metric: str) -> tuple:
    """The block's k best for every query, and the targets of those rows (if the block has targets)."""
    X, xsq = block[0], block[1]
    dist, idx = kernels.knn_block(X, xsq, queries, k, meta[1], metric)
    targets = block[2][idx - meta[1]] if len(block) > 2 and block[2] is not None else None
    return dist, idx, targets


class _NeighborsBase(DistributedMixin, BaseEstimator):
    _on_device = True
    n_neighbors: int
    metric: str
    p: Any
    _shards_fit: Shards
    _has_targets = False

    def _metric(self) -> str:
        metric = self.metric
        if metric == "minkowski":
            if self.p != 2:
                raise ValueError(f"metric='minkowski' with p={self.p}: hpdl.ml supports p=2 (euclidean) only")
            return "euclidean"
        if metric not in METRICS:
            raise ValueError(f"metric={metric!r} is not supported by hpdl.ml; use one of {METRICS} or 'minkowski'")
        return metric

    def _fit_index(self, X: Any, targets: Optional[list] = None, check: Any = None) -> None:
        self._validate_params()
        self._fit_metric = self._metric()
        if getattr(self, "algorithm", "auto") not in ("auto", "brute"):
            raise ValueError(f"algorithm={self.algorithm!r}: hpdl.ml searches by brute force; use 'auto' or 'brute'")
        shards = self._shards(X, targets or [], check=check)
        # what kneighbors() answers in: an empty array of X's kind (a slice would keep X alive)
        self._fitted_kind = device.like(np.zeros(0, np.int8), X) if device.is_device_array(X) else None
        self._shards_fit = shards.transform(_index_block)
        self.n_samples_fit_ = shards.n_samples
        self.effective_metric_ = self._fit_metric

    def kneighbors(self, X: Any = None, n_neighbors: Optional[int] = None, return_distance: bool = True) -> Any:
        """Distances (euclidean or cosine) and global indices of the k nearest fitted rows of each query row.

        With `comm`, each rank passes its own query rows (possibly none) and
        gets the answers for those rows. `X=None`: the fitted rows of this
        rank (or all, in one process), each excluding itself, as scikit-learn.
        """
        dist, idx, _ = self._query(X, n_neighbors)
        like = self._fitted_kind if X is None else X  # a device array in: device arrays out
        dist, idx = device.like(dist, like), device.like(idx, like)
        return (dist, idx) if return_distance else idx

    def _query(self, X: Any, n_neighbors: Optional[int]) -> tuple[np.ndarray, np.ndarray, Any]:
        self._check_fitted("n_samples_fit_")
        k = self.n_neighbors if n_neighbors is None else n_neighbors
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k <= 0:
            raise ValueError(f"Expected n_neighbors > 0. Got {k}")
        shards = self._shards_fit
        exclude_self = X is None
        if exclude_self:
            queries = self._own_rows()
            k_search = k + 1
        else:
            comm = self.comm if self.comm is not None and self.comm.size > 1 else None
            try:
                queries = self._check_queries(X)
            except (ValueError, TypeError) as exc:
                if comm is None:
                    raise
                agree_on_layout(comm, exc, type(self).__name__, allow_all_empty=True)  # every rank raises
                raise
            k_search = k
        if k_search > shards.n_samples:
            raise ValueError(
                f"Expected n_neighbors <= n_samples_fit, but n_neighbors = {k_search}, n_samples_fit = "
                f"{shards.n_samples}, n_samples = {len(queries)}"
            )
        comm = self.comm if self.comm is not None and self.comm.size > 1 else None
        if comm is not None:
            sizes = agree_on_layout(comm, queries, type(self).__name__, allow_all_empty=True)
            shared = queries.contiguous() if isinstance(queries, torch.Tensor) else np.ascontiguousarray(queries)
            every = comm.allgather(shared, sizes=sizes)
            start = int(sum(sizes[: comm.rank]))
            mine = slice(start, start + len(queries))
        else:
            every, mine = queries, slice(0, len(queries))
        parts = shards.gather(_search, every, k_search, self._fit_metric)
        candidates = [(p[0][mine], p[1][mine]) for p in parts]
        extra = [p[2][mine] for p in parts] if self._has_targets else None
        dist, idx, targets = kernels.merge_topk(candidates, k_search, extra)
        if exclude_self:
            dist, idx, targets = self._drop_self(dist, idx, targets, k)
        if self._fit_metric == "euclidean":
            dist = np.sqrt(dist)
        return dist, idx, targets

    def _own_rows(self) -> np.ndarray:
        shards = self._shards_fit
        if hasattr(shards, "block"):
            return shards.block[0]  # type: ignore[attr-defined]
        raise ValueError("kneighbors(X=None) needs the fitted data in this process; pass the query rows explicitly")

    def _drop_self(self, dist: np.ndarray, idx: np.ndarray, targets: Any, k: int) -> tuple:
        """Remove each row's own index (or, if absent because of duplicates, the last neighbour)."""
        shards = self._shards_fit
        offset = shards.meta[1] if hasattr(shards, "meta") else 0  # type: ignore[attr-defined]
        own = np.arange(len(idx)) + offset
        mask = idx != own[:, None]
        mask[mask.sum(1) > k, -1] = False
        shape = (len(idx), k)
        pick = (dist[mask].reshape(shape), idx[mask].reshape(shape))
        return (*pick, None if targets is None else targets[mask].reshape(shape + targets.shape[2:]))

    def _check_queries(self, X: Any) -> Any:
        if is_dask_array(X):  # queries are small beside the index: they come to the caller in one piece
            X = X.compute()
        return self._check_predict_input(X, self._shards_fit.dtype)

    def _weights(self, dist: np.ndarray) -> Optional[np.ndarray]:
        if self.weights == "uniform":  # type: ignore[attr-defined]
            return None
        if callable(self.weights):  # type: ignore[attr-defined]
            return np.asarray(self.weights(dist))  # type: ignore[attr-defined]
        with np.errstate(divide="ignore"):
            w = 1.0 / dist
        zero = np.isinf(w)
        rows = zero.any(1)
        w[rows] = zero[rows]  # an exact match takes all the weight, as in scikit-learn
        return w

    def _global_sum(self, values: np.ndarray) -> np.ndarray:
        out = np.ascontiguousarray(values, dtype=np.float64)
        if self.comm is not None and self.comm.size > 1:
            self.comm.allreduce(out)
        return out


_COMMON = {
    "n_neighbors": [Interval(Integral, 1, None, closed="left"), None],
    "algorithm": [StrOptions({"auto", "ball_tree", "kd_tree", "brute"})],
    "leaf_size": [Interval(Integral, 1, None, closed="left")],
    "p": "no_validation",
    "metric": [str],
    "metric_params": [dict, None],
    "n_jobs": [Integral, None],
    "comm": "no_validation",
}


class NearestNeighbors(_NeighborsBase):
    """Unsupervised k nearest neighbours (brute force; euclidean or cosine) like scikit-learn's."""

    _parameter_constraints: dict = {**_COMMON, "radius": "no_validation"}

    def __init__(
        self,
        *,
        n_neighbors: int = 5,
        radius: float = 1.0,
        algorithm: str = "auto",
        leaf_size: int = 30,
        metric: str = "minkowski",
        p: Any = 2,
        metric_params: Any = None,
        n_jobs: Any = None,
        comm: Any = None,
    ):
        self.n_neighbors = n_neighbors
        self.radius = radius
        self.algorithm = algorithm
        self.leaf_size = leaf_size
        self.metric = metric
        self.p = p
        self.metric_params = metric_params
        self.n_jobs = n_jobs
        self.comm = comm

    def fit(self, X: Any, y: Any = None) -> NearestNeighbors:
        """Index X (an array, this rank's shard with `comm`, or a Dask array; it stays where it is)."""
        self._fit_index(X)
        return self


def _target_check(encode: Any) -> Any:
    def check(Xv: np.ndarray, extra: list) -> list:
        y = extra[0]
        if y is None:
            raise ValueError("requires y to be passed, but the target y is None")
        y = check_array(y, ensure_2d=False, dtype=None, ensure_min_samples=0, input_name="y")
        check_consistent_length(Xv, y)
        return [encode(y)]

    return check


class KNeighborsClassifier(ClassifierMixin, _NeighborsBase):
    """Vote among the k nearest fitted rows (weights "uniform" or "distance"); classes found across all ranks."""

    _parameter_constraints: dict = {
        **_COMMON,
        "weights": [StrOptions({"uniform", "distance"}), callable, None],
    }
    _has_targets = True

    def __init__(
        self,
        n_neighbors: int = 5,
        *,
        weights: Any = "uniform",
        algorithm: str = "auto",
        leaf_size: int = 30,
        p: Any = 2,
        metric: str = "minkowski",
        metric_params: Any = None,
        n_jobs: Any = None,
        comm: Any = None,
    ):
        self.n_neighbors = n_neighbors
        self.weights = weights
        self.algorithm = algorithm
        self.leaf_size = leaf_size
        self.p = p
        self.metric = metric
        self.metric_params = metric_params
        self.n_jobs = n_jobs
        self.comm = comm

    def fit(self, X: Any, y: Any) -> KNeighborsClassifier:
        """Index X with its labels y (this rank's rows with `comm`; Dask arrays stay on the workers)."""
        if is_dask_array(X):
            import dask.array as da

            if y is None:
                raise ValueError("requires y to be passed, but the target y is None")
            y = y if is_dask_array(y) else da.from_array(np.asarray(y))
            self.classes_ = np.unique(da.unique(y).compute())
            encoded = y.map_blocks(_encode, self.classes_, dtype=np.int64)
            self._fit_index(X, [encoded])
            return self
        y = device.host(y) if device.is_device_array(y) else y  # labels stay on the host, beside classes_
        self.classes_ = global_classes(y, self.comm)  # "Unknown label type" for a continuous y, on every rank
        self._fit_index(X, [y], check=_target_check(lambda yv: _encode(yv, self.classes_)))
        return self

    def predict_proba(self, X: Any) -> Any:
        """Share of the (weighted) vote of each class, for each query row."""
        return device.like(self._proba(X), X)

    def _proba(self, X: Any) -> np.ndarray:
        self._check_fitted("n_samples_fit_")
        dist, _, codes = self._query(X, None)
        w = self._weights(dist)
        proba = np.zeros((len(dist), len(self.classes_)))
        rows = np.repeat(np.arange(len(dist)), codes.shape[1])
        np.add.at(proba, (rows, codes.ravel()), 1.0 if w is None else w.ravel())
        total = proba.sum(1, keepdims=True)
        total[total == 0] = 1.0
        return proba / total

    def predict(self, X: Any) -> Any:
        """The class with the largest (weighted) vote; ties go to the smaller class, as in scikit-learn."""
        return device.like(self._labels(X), X)

    def _labels(self, X: Any) -> np.ndarray:
        proba = self._proba(X)  # first: it checks that the model is fitted
        return self.classes_[np.argmax(proba, axis=1)]

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """Accuracy over every rank's query rows with `comm`."""
        pred = self._labels(X)
        y = np.asarray(device.host(y))
        sample_weight = device.host(sample_weight)
        w = np.ones(len(y)) if sample_weight is None else np.asarray(sample_weight, np.float64)
        correct, total = self._global_sum(np.array([float(np.dot(w, pred == y)), float(w.sum())]))
        return float(correct / total) if total else 0.0


class KNeighborsRegressor(MultiOutputMixin, RegressorMixin, _NeighborsBase):
    """Mean (or inverse-distance-weighted mean) of the k nearest fitted rows' targets."""

    _parameter_constraints: dict = {
        **_COMMON,
        "weights": [StrOptions({"uniform", "distance"}), callable, None],
    }
    _has_targets = True

    def __init__(
        self,
        n_neighbors: int = 5,
        *,
        weights: Any = "uniform",
        algorithm: str = "auto",
        leaf_size: int = 30,
        p: Any = 2,
        metric: str = "minkowski",
        metric_params: Any = None,
        n_jobs: Any = None,
        comm: Any = None,
    ):
        self.n_neighbors = n_neighbors
        self.weights = weights
        self.algorithm = algorithm
        self.leaf_size = leaf_size
        self.p = p
        self.metric = metric
        self.metric_params = metric_params
        self.n_jobs = n_jobs
        self.comm = comm

    def fit(self, X: Any, y: Any) -> KNeighborsRegressor:
        """Index X with its targets y (1-D or 2-D)."""
        if is_dask_array(X):
            if y is None:
                raise ValueError("requires y to be passed, but the target y is None")
            self._one_d = y.ndim == 1
            self._fit_index(X, [y.astype(np.float64)])
            return self

        def encode(yv: np.ndarray) -> np.ndarray:  # y's shape is read after validation (not with np.ndim)
            self._one_d = yv.ndim == 1
            return np.asarray(yv, dtype=np.float64)

        self._fit_index(X, [y], check=_target_check(encode))
        return self

    def predict(self, X: Any) -> Any:
        """The (weighted) mean of the k nearest rows' targets."""
        return device.like(self._mean(X), X)

    def _mean(self, X: Any) -> np.ndarray:
        dist, _, targets = self._query(X, None)
        w = self._weights(dist)
        t = targets if targets.ndim == 3 else targets[:, :, None]
        if w is None:
            out = t.mean(axis=1)
        else:
            out = (t * w[:, :, None]).sum(1) / w.sum(1)[:, None]
        return out[:, 0] if self._one_d else out

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """R^2 over every rank's query rows with `comm` (uniform average over targets)."""
        pred = self._mean(X)
        y, sample_weight = device.host(y), device.host(sample_weight)
        if self.comm is None or self.comm.size == 1:
            return float(r2_score(y, pred, sample_weight=sample_weight))
        y2 = np.asarray(y, np.float64).reshape(len(pred), -1)
        p2 = np.asarray(pred, np.float64).reshape(len(pred), -1)
        w = np.ones(len(y2)) if sample_weight is None else _check_sample_weight(sample_weight, y2)
        first = self._global_sum(np.concatenate([[w.sum()], w @ y2]))
        mean = first[1:] / first[0]
        res = self._global_sum(np.concatenate([w @ (y2 - p2) ** 2, w @ (y2 - mean) ** 2]))
        t = y2.shape[1]
        ss_res, ss_tot = res[:t], res[t:]
        r2 = np.where(ss_tot > 0, 1 - ss_res / np.where(ss_tot > 0, ss_tot, 1), 0.0)
        return float(np.mean(r2))


def _encode(y: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """Class positions in `classes` (labels unknown to `classes` cannot occur: classes are the union)."""
    return np.searchsorted(classes, np.asarray(y).ravel()).astype(np.int64)
