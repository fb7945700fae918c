"""K-Means (Lloyd) with scikit-learn's API, in one process, SPMD on ranks, or on a Dask cluster.

Each iteration is one pass over every block (chunked matrix-product
distances, argmin, per-centre sums) and one reduction of (sums, weights):
one allreduce on MPI. Blocks this process holds skip the rows whose label
Hamerly's bounds prove unchanged (`hpdl.ml.bounds`). The algorithm is scikit-learn's
`_kmeans_single_lloyd`: data centred on its mean first, convergence when the
squared centre shift is at most `tol` x the mean feature variance, empty
clusters re-seeded with the points farthest from their centre, and the
final labels and inertia recomputed against the final centres. The same
initial centres therefore give scikit-learn's centres and inertia.
"""

from __future__ import annotations

import warnings
from numbers import Integral, Real
from typing import Any, Optional

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassNamePrefixFeaturesOutMixin, ClusterMixin, TransformerMixin
from sklearn.cluster import KMeans as _SkKMeans
from sklearn.cluster._kmeans import _is_same_clustering, _kmeans_plusplus
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils import check_random_state
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.validation import check_array

from hpdl.ml import bounds, device, kernels
from hpdl.ml.base import Shards, numpy_dtype
from hpdl.ml.estimator import DistributedMixin, weights_check

__all__ = ["KMeans"]

KMEANS_PARALLEL_ROUNDS = 5
"""Rounds of k-means|| oversampling (Bahmani et al. 2012 find ~5 enough), each drawing ~2k candidates."""


# --------------------------------------------------------------------------- block functions (run where the data is)
def _column_sums(block: tuple, meta: Any) -> tuple:
    return (kernels.column_sums(block[0]),)


def _prepare(block: tuple, meta: Any, mean: np.ndarray) -> tuple:
    """(X - mean, ||X - mean||^2, w): centring first keeps float32 distances accurate, as scikit-learn does.

    A device block keeps its weights beside it on the device, in its dtype.
    """
    X, w = block[0], block[1]
    Xc = kernels.shifted(X, mean)
    if w is not None and isinstance(Xc, torch.Tensor):
        w = torch.as_tensor(w, dtype=Xc.dtype, device=Xc.device)
    return Xc, kernels.row_sq_norms(Xc), w


def _sq_total(block: tuple, meta: Any) -> tuple:
    return (kernels.total(block[1]),)


def _lloyd_block(block: tuple, meta: Any, centres: np.ndarray) -> tuple:
    sums, counts, _ = kernels.lloyd_partial(block[0], block[1], block[2], centres)
    return device.host(sums), device.host(counts)


def _with_bounds(block: tuple, meta: Any, centres: np.ndarray) -> tuple:
    """The block with Hamerly bounds beside it, or the block alone where they cannot serve it."""
    X, xsq, w = block
    return (X, xsq, w, bounds.State(X.shape[0], *centres.shape)) if bounds.usable(X, xsq, w) else block


def _bounded_block(block: tuple, meta: Any, centres: np.ndarray, moves: Optional[np.ndarray]) -> tuple:
    if len(block) == 3:
        return _lloyd_block(block, meta, centres)
    return bounds.partial(block[0], block[1], block[2], centres, moves, block[3])


def _labels_block(block: tuple, meta: Any, centres: np.ndarray) -> np.ndarray:
    return kernels.assign(block[0], block[1], centres)[0]


def _final_block(block: tuple, meta: Any, centres: np.ndarray) -> tuple:
    labels = kernels.assign(block[0], block[1], centres)[0]
    sizes = np.bincount(device.host(labels), minlength=len(centres))
    return kernels.exact_inertia(block[0], block[2], centres, labels), sizes


def _farthest_block(block: tuple, meta: Any, centres: np.ndarray, count: int) -> tuple:
    return kernels.farthest(block[0], block[1], block[2], centres, count, meta[1])


def _potential(block: tuple, centres: Optional[np.ndarray]) -> np.ndarray:
    """w * (squared distance to the nearest centre), or w alone when there is no centre yet."""
    X, xsq, w = block
    base = np.ones(X.shape[0]) if w is None else np.asarray(device.host(w), dtype=np.float64)
    if centres is None or len(centres) == 0:
        return base
    return base * device.host(kernels.min_sq_dist(X, xsq, centres)).astype(np.float64)


def _potential_total(block: tuple, meta: Any, centres: Optional[np.ndarray]) -> float:
    return float(_potential(block, centres).sum())


def _potential_sum(block: tuple, meta: Any, centres: Optional[np.ndarray]) -> tuple:
    return (_potential_total(block, meta, centres),)


def _pick_block(block: tuple, meta: Any, centres: Optional[np.ndarray], targets: list) -> tuple:
    """Rows where the cumulative potential crosses each target (targets given in this block's own scale)."""
    mine = [(pos, value) for pos, index, value in targets if index == meta[0]]
    if not mine:
        return [], np.zeros((0, block[0].shape[1]), numpy_dtype(block[0].dtype))
    cumulative = np.cumsum(_potential(block, centres))
    rows = [min(int(np.searchsorted(cumulative, v)), block[0].shape[0] - 1) for _, v in mine]
    return [p for p, _ in mine], _rows(block[0], np.asarray(rows, dtype=np.int64))


def _candidate_block(block: tuple, meta: Any, centres: np.ndarray, candidates: np.ndarray) -> tuple:
    """For each candidate, the block's potential if it were added (scikit-learn's greedy k-means++ trial)."""
    X, xsq, w = block
    current = device.host(kernels.min_sq_dist(X, xsq, centres)).astype(np.float64)
    weights = None if w is None else np.asarray(device.host(w), dtype=np.float64)
    out = np.empty(len(candidates))
    for j, c in enumerate(candidates):
        d = np.minimum(current, device.host(kernels.min_sq_dist(X, xsq, c[None, :])).astype(np.float64))
        out[j] = d.sum() if weights is None else float(np.dot(d, weights))
    return (out,)


def _oversample_block(block: tuple, meta: Any, centres: np.ndarray, factor: float, seed: int, rnd: int) -> np.ndarray:
    """k-means|| round: keep each row with probability min(1, factor * w * d^2) (its own stream per block)."""
    X = block[0]
    if X.shape[0] == 0:
        return np.zeros((0, X.shape[1]), numpy_dtype(X.dtype))
    p = np.minimum(1.0, factor * _potential(block, centres))
    rng = np.random.default_rng([seed, rnd, meta[0]])
    return _rows(X, np.flatnonzero(rng.random(X.shape[0]) < p))


def _rows(X: Any, index: np.ndarray) -> np.ndarray:
    """Copies of X's rows `index` on the host (from the device for a device block)."""
    if isinstance(X, torch.Tensor):
        return device.host(X[torch.from_numpy(index).to(X.device)])
    return X[index]


def _nearest_weights(block: tuple, meta: Any, centres: np.ndarray) -> tuple:
    labels = device.host(kernels.assign(block[0], block[1], centres)[0])
    w = None if block[2] is None else np.asarray(device.host(block[2]), np.float64)
    return (np.bincount(labels, weights=w, minlength=len(centres)),)


# --------------------------------------------------------------------------- initialisation
def _pick(shards: Shards, centres: Optional[np.ndarray], rng: np.random.RandomState, count: int) -> np.ndarray:
    """`count` rows drawn with probability proportional to the potential (w * d^2, or w with no centres)."""
    totals = np.array(shards.gather(_potential_total, centres), dtype=np.float64)
    grand = totals.sum()
    cumulative = np.cumsum(totals)
    draws = rng.uniform(size=count) * grand
    targets = []
    for pos, value in enumerate(draws):
        index = min(int(np.searchsorted(cumulative, value, side="right")), len(totals) - 1)
        while totals[index] == 0 and index > 0:
            index -= 1
        start = cumulative[index] - totals[index]
        targets.append((pos, index, float(value - start)))
    out = np.empty((count, shards.n_features), dtype=shards.dtype)
    for positions, rows in shards.gather(_pick_block, centres, targets):
        if len(positions):
            out[positions] = rows
    return out


def _kmeans_plusplus_distributed(shards: Shards, k: int, rng: np.random.RandomState) -> np.ndarray:
    """scikit-learn's greedy k-means++ (2 + log k trials per centre) over blocks: three small collectives a centre."""
    trials = 2 + int(np.log(k))
    centres = _pick(shards, None, rng, 1)
    for _ in range(1, k):
        candidates = _pick(shards, centres, rng, trials)
        potentials = shards.reduce(_candidate_block, centres, candidates)[0]
        centres = np.vstack([centres, candidates[int(np.argmin(potentials))]])
    return centres


def _kmeans_parallel(shards: Shards, k: int, rng: np.random.RandomState) -> np.ndarray:
    """k-means|| (Bahmani et al. 2012): oversample ~2k rows per round, then weighted k-means++ on the candidates."""
    centres = _pick(shards, None, rng, 1)
    seed = int(rng.randint(2**31 - 1))
    for rnd in range(KMEANS_PARALLEL_ROUNDS):
        phi = float(shards.reduce(_potential_sum, centres)[0])
        if phi <= 0:
            break
        drawn = [rows for rows in shards.gather(_oversample_block, centres, 2.0 * k / phi, seed, rnd) if len(rows)]
        if drawn:
            centres = np.vstack([centres, *drawn])
    if len(centres) < k:  # too few distinct rows were drawn: fill up like "random"
        centres = np.vstack([centres, _pick(shards, None, rng, k - len(centres))])
    if len(centres) == k:
        return centres
    weights = shards.reduce(_nearest_weights, centres)[0]
    xsq = np.einsum("ij,ij->i", centres, centres)
    seeds, _ = _kmeans_plusplus(centres, k, x_squared_norms=xsq, random_state=rng, sample_weight=weights)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        small = _SkKMeans(k, init=seeds, n_init=1, max_iter=30).fit(centres, sample_weight=np.maximum(weights, 0))
    return np.asarray(small.cluster_centers_, dtype=shards.dtype)


# --------------------------------------------------------------------------- Lloyd
def _relocate_empty(shards: Shards, centres: np.ndarray, sums: np.ndarray, counts: np.ndarray) -> None:
    """scikit-learn's `_relocate_empty_clusters_dense`: each empty cluster takes one of the farthest points."""
    empty = np.flatnonzero(counts == 0)
    parts = shards.gather(_farthest_block, centres, len(empty))
    dist = np.concatenate([p[0] for p in parts])
    gidx = np.concatenate([p[1] for p in parts])
    rows = np.concatenate([p[2] for p in parts])
    weights = np.concatenate([p[3] for p in parts])
    labels = np.concatenate([p[4] for p in parts])
    order = np.lexsort((gidx, -dist))[: len(empty)]
    for new_id, j in zip(empty, order):
        old_id = labels[j]
        x = rows[j].astype(np.float64) * weights[j]
        sums[old_id] -= x
        sums[new_id] = x
        counts[new_id] = weights[j]
        counts[old_id] -= weights[j]


def _lloyd(shards: Shards, centres: np.ndarray, max_iter: int, tol: float) -> tuple[np.ndarray, int]:
    """Lloyd iterations until the squared centre shift is <= tol; returns (centres, iterations).

    Blocks this process holds carry Hamerly bounds (`hpdl.ml.bounds`) so that
    most rows skip the distance computation once the centres settle; Dask
    blocks take the plain step.
    """
    dtype = shards.dtype
    live = shards.transform(_with_bounds, centres) if shards.holds_blocks else None
    moves: Optional[np.ndarray] = None
    it = 0
    for it in range(max_iter):  # noqa: B007 - the count after the loop is n_iter_
        if live is None:
            sums, counts = shards.reduce(_lloyd_block, centres)
        else:
            sums, counts = live.reduce(_bounded_block, centres, moves)
        if (counts == 0).any():
            _relocate_empty(shards, centres, sums, counts)
        positive = counts > 0
        sums[positive] /= counts[positive, None]
        new = sums.astype(dtype)
        shift = float(((new.astype(np.float64) - centres) ** 2).sum())
        moves = bounds.moves_between(centres, new)
        centres = new
        if shift <= tol:
            break
    return centres, it + 1


class KMeans(DistributedMixin, ClassNamePrefixFeaturesOutMixin, TransformerMixin, ClusterMixin, BaseEstimator):
    """K-Means clustering (Lloyd) with scikit-learn's parameters and attributes, on one process, ranks or Dask.

    `init="auto"` (the default) is scikit-learn's "k-means++" in one process
    and "k-means||" (scalable k-means++) when the data is distributed. `comm`
    (an hpdl Communicator): every rank passes its own shard of rows to `fit`
    and ends with the same model (`labels_` holds the labels of its own
    rows). A Dask array runs on the workers of the current Client.
    """

    _on_device = True
    _parameter_constraints: dict = {
        "n_clusters": [Interval(Integral, 1, None, closed="left")],
        "init": [StrOptions({"auto", "k-means++", "k-means||", "random"}), "array-like"],
        "n_init": [StrOptions({"auto"}), Interval(Integral, 1, None, closed="left")],
        "max_iter": [Interval(Integral, 1, None, closed="left")],
        "tol": [Interval(Real, 0, None, closed="left")],
        "verbose": ["verbose"],
        "random_state": ["random_state"],
        "copy_x": ["boolean"],
        "algorithm": [StrOptions({"lloyd"})],
        "comm": "no_validation",
    }

    def __init__(
        self,
        n_clusters: int = 8,
        *,
        init: Any = "auto",
        n_init: Any = "auto",
        max_iter: int = 300,
        tol: float = 1e-4,
        verbose: int = 0,
        random_state: Any = None,
        copy_x: bool = True,
        algorithm: str = "lloyd",
        comm: Any = None,
    ):
        self.n_clusters = n_clusters
        self.init = init
        self.n_init = n_init
        self.max_iter = max_iter
        self.tol = tol
        self.verbose = verbose
        self.random_state = random_state
        self.copy_x = copy_x
        self.algorithm = algorithm
        self.comm = comm

    # ------------------------------------------------------------------ fit
    def fit(self, X: Any, y: Any = None, sample_weight: Any = None) -> KMeans:
        """Cluster X (an array, this rank's shard with `comm`, or a Dask array)."""
        self._validate_params()
        shards = self._shards(X, [sample_weight], check=weights_check(0))
        k = self.n_clusters
        if shards.n_samples < k:
            raise ValueError(f"n_samples={shards.n_samples} should be >= n_clusters={k}.")
        init = self._resolve_init(shards)
        n_init = self._n_runs(init)
        rng = check_random_state(self.random_state)
        comm = getattr(shards, "comm", None)
        if comm is not None:  # one stream for every rank, even with random_state=None
            rng = np.random.RandomState(comm.broadcast_object(int(rng.randint(2**31 - 1))))
        mean = shards.reduce(_column_sums)[0] / shards.n_samples
        data = shards.transform(_prepare, mean)
        variance = float(data.reduce(_sq_total)[0]) / (shards.n_samples * shards.n_features)
        tol = variance * self.tol if self.tol else 0.0
        best: Optional[tuple[float, np.ndarray, int, np.ndarray]] = None
        for _ in range(n_init):
            start = self._initial_centres(data, init, rng, mean)
            centres, n_iter = _lloyd(data, start, self.max_iter, tol)
            inertia, sizes = data.reduce(_final_block, centres)
            if best is None or (float(inertia) < best[0] and not self._same_clustering(data, centres, best[1])):
                best = (float(inertia), centres, n_iter, sizes)
        if best is None:  # n_init >= 1 is validated: unreachable
            raise RuntimeError("KMeans: no initialisation ran")
        best_inertia, centres, n_iter, sizes = best
        self.cluster_centers_ = (centres.astype(np.float64) + mean).astype(shards.dtype)
        self.labels_ = device.like(_detached(data.map(_labels_block, centres, dtype=np.int32)), X)
        self.inertia_ = best_inertia
        self.n_iter_ = n_iter
        self._n_features_out = k
        distinct = int((sizes > 0).sum())
        if distinct < k:
            warnings.warn(
                f"Number of distinct clusters ({distinct}) found smaller than n_clusters ({k}). "
                "Possibly due to duplicate points in X.",
                ConvergenceWarning,
                stacklevel=2,
            )
        return self

    def _same_clustering(self, data: Shards, centres: np.ndarray, other: np.ndarray) -> bool:
        """scikit-learn keeps an earlier run whose clustering is the same up to relabelling (rounding noise)."""
        if data.distributed:
            return False
        first = device.host(data.map(_labels_block, centres, dtype=np.int32))
        second = device.host(data.map(_labels_block, other, dtype=np.int32))
        return bool(_is_same_clustering(first, second, self.n_clusters))

    def _resolve_init(self, shards: Shards) -> Any:
        init = self.init
        if isinstance(init, str):
            if init == "auto":
                return "k-means||" if shards.distributed else "k-means++"
            return init
        centres = check_array(init, dtype=shards.dtype, copy=True, order="C", input_name="init")
        if centres.shape[0] != self.n_clusters:
            raise ValueError(
                f"The shape of the initial centers {centres.shape} does not match the number of clusters "
                f"{self.n_clusters}."
            )
        if centres.shape[1] != shards.n_features:
            raise ValueError(
                f"The shape of the initial centers {centres.shape} does not match the number of features of the "
                f"data {shards.n_features}."
            )
        return centres

    def _n_runs(self, init: Any) -> int:
        if self.n_init != "auto":
            if not isinstance(init, str) and self.n_init != 1:
                warnings.warn(
                    f"Explicit initial center position passed: performing only one init in {type(self).__name__} "
                    f"instead of n_init={self.n_init}.",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return 1
            return int(self.n_init)
        return 10 if isinstance(init, str) and init == "random" else 1

    def _initial_centres(self, data: Shards, init: Any, rng: np.random.RandomState, mean: np.ndarray) -> np.ndarray:
        """Centres in the centred frame of `data`; one process reproduces scikit-learn's random draws exactly."""
        k = self.n_clusters
        if not isinstance(init, str):
            return (init.astype(np.float64) - mean).astype(data.dtype)
        local = not data.distributed
        on_host = isinstance(data.block[0], np.ndarray) if local else True  # type: ignore[attr-defined]
        if init == "k-means++":
            if local and on_host:
                X, xsq, w = data.block  # type: ignore[attr-defined]
                weights = np.ones(X.shape[0], dtype=X.dtype) if w is None else w
                return _kmeans_plusplus(X, k, x_squared_norms=xsq, random_state=rng, sample_weight=weights)[0]
            return _kmeans_plusplus_distributed(data, k, rng)
        if init == "random":
            if local:
                X, _, w = data.block  # type: ignore[attr-defined]
                weights = np.ones(X.shape[0]) if w is None else np.asarray(device.host(w), dtype=np.float64)
                seeds = rng.choice(X.shape[0], size=k, replace=False, p=weights / weights.sum())
                return _rows(X, seeds)
            return _pick(data, None, rng, k)
        return _kmeans_parallel(data, k, rng)

    # ------------------------------------------------------------------ use
    def predict(self, X: Any) -> Any:
        """Index of the nearest centre of each row (local rows with `comm`; a lazy Dask array for Dask input)."""
        self._check_fitted("cluster_centers_")
        rows = self._check_predict_input(X, self.cluster_centers_.dtype)
        return device.like(self._map(rows, _predict_block, self.cluster_centers_, dtype=np.int32), X)

    def transform(self, X: Any) -> Any:
        """Euclidean distance of each row to every centre."""
        self._check_fitted("cluster_centers_")
        rows = self._check_predict_input(X, self.cluster_centers_.dtype)
        out = self._map(
            rows, _transform_block, self.cluster_centers_, dtype=self.cluster_centers_.dtype, tail=(self.n_clusters,)
        )
        return device.like(out, X)

    def fit_predict(self, X: Any, y: Any = None, sample_weight: Any = None) -> Any:
        return self.fit(X, sample_weight=sample_weight).labels_

    def fit_transform(self, X: Any, y: Any = None, sample_weight: Any = None) -> Any:
        return self.fit(X, sample_weight=sample_weight).transform(X)

    def score(self, X: Any, y: Any = None, sample_weight: Any = None) -> float:
        """Opposite of the inertia of X on the fitted centres (over every rank's rows with `comm`)."""
        self._check_fitted("cluster_centers_")
        shards = self._shards_for_scoring(X, sample_weight)
        xsq = shards.transform(_with_norms)
        inertia = xsq.reduce(_final_block, self.cluster_centers_)[0]
        return -float(inertia)

    def _shards_for_scoring(self, X: Any, sample_weight: Any) -> Shards:
        fitted = self.n_features_in_
        shards = self._shards(X, [sample_weight], dtype=(self.cluster_centers_.dtype,), check=weights_check(0))
        if shards.n_features != fitted:
            self.n_features_in_ = fitted
            raise ValueError(f"X has {shards.n_features} features, but KMeans is expecting {fitted} features as input.")
        return shards

    def _map(self, X: Any, fn: Any, *args: Any, dtype: Any, tail: tuple = ()) -> Any:
        from hpdl.ml.base import is_dask_array

        if is_dask_array(X):
            from hpdl.ml.dask_backend import map_rows

            return map_rows(X, fn, *args, dtype=dtype, tail=tail)
        return fn((X,), (0, 0), *args)

    def __sklearn_tags__(self) -> Any:
        tags = super().__sklearn_tags__()
        tags.input_tags.sparse = False
        return tags


def _detached(labels: Any) -> Any:
    """Labels that no longer need the centred copy of X: a lazy Dask array would keep that copy (persisted on the
    workers by `fit`) for the model's whole life, so Dask labels are persisted now (n int32 values) and the
    centred blocks are released when `fit` returns. They are the labels of the final centres in the centred frame,
    exactly as scikit-learn computes them."""
    persist = getattr(labels, "persist", None)
    return persist() if persist is not None else labels


def _predict_block(block: tuple, meta: Any, centres: np.ndarray) -> np.ndarray:
    return kernels.assign(block[0], None, centres)[0]


def _transform_block(block: tuple, meta: Any, centres: np.ndarray) -> Any:
    X = block[0]
    if isinstance(X, torch.Tensor):
        C = torch.as_tensor(np.asarray(centres), dtype=X.dtype, device=X.device)
        return torch.cdist(X, C)
    return np.sqrt(_sq_distances(X, centres))


def _sq_distances(X: np.ndarray, centres: np.ndarray) -> np.ndarray:
    C = np.asarray(centres, dtype=X.dtype)
    d = (X * X).sum(1)[:, None] - 2 * (X @ C.T) + (C * C).sum(1)[None, :]
    return np.maximum(d, 0)


def _with_norms(block: tuple, meta: Any) -> tuple:
    X, w = block[0], block[1]
    return X, kernels.row_sq_norms(X), w
