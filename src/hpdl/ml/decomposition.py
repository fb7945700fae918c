"""PCA and TruncatedSVD with scikit-learn's API: one process, SPMD ranks or Dask, from reduced moments.

PCA: pass 1 reduces the column sums (the mean), pass 2 either the centred
Gram matrix sum (x - m)(x - m)^T in float64 (`svd_solver="covariance_eigh"`,
the default: one d x d reduction, then `eigh`) or, for `"full"` / `"tsqr"`,
each block's R factor of X - m, gathered and factorised again (TSQR), whose
SVD has X - m's singular values and right singular vectors without squaring
the condition number. TruncatedSVD is the same on the uncentred data.
Signs follow scikit-learn's `svd_flip(..., u_based_decision=False)`: the
largest entry (in absolute value) of every component is positive.
"""

from __future__ import annotations

from numbers import Integral, Real
from typing import Any

import numpy as np
import scipy.linalg
from sklearn.base import BaseEstimator, ClassNamePrefixFeaturesOutMixin, TransformerMixin
from sklearn.decomposition._pca import _infer_dimension
from sklearn.utils._param_validation import Interval, RealNotInt, StrOptions

from hpdl.ml import kernels
from hpdl.ml.base import Shards, is_dask_array
from hpdl.ml.estimator import DistributedMixin

__all__ = ["PCA", "TruncatedSVD"]


def _sums(block: tuple, meta: Any) -> tuple:
    return (block[0].sum(axis=0, dtype=np.float64),)


def _moments(block: tuple, meta: Any) -> tuple:
    """(column sums, X^T X) of a block in float64, in one pass (scikit-learn's "covariance_eigh" moments)."""
    X = block[0]
    if X.dtype == np.float64:
        return X.sum(axis=0), X.T @ X  # NumPy runs A.T @ A as one symmetric rank-k update
    d = X.shape[1]
    sums, gram = np.zeros(d), np.zeros((d, d))
    step = kernels.chunk_rows(d, 0, 8)
    for s in range(0, X.shape[0], step):
        x = X[s : s + step].astype(np.float64)
        sums += x.sum(axis=0)
        gram += x.T @ x
    return sums, gram


def _local_r(block: tuple, meta: Any, mean: np.ndarray) -> np.ndarray:
    A = np.asarray(block[0], np.float64) - mean
    if A.shape[0] == 0:
        return np.zeros((0, A.shape[1]))
    return scipy.linalg.qr(A, mode="r", check_finite=False)[0][: A.shape[1]]


def _project(block: tuple, meta: Any, mean: np.ndarray, components: np.ndarray, scale: np.ndarray) -> np.ndarray:
    X = block[0]
    out = (X - mean.astype(X.dtype, copy=False)) @ components.T.astype(X.dtype, copy=False)
    return out / scale.astype(X.dtype, copy=False) if scale is not None else out


def _flip(components: np.ndarray) -> np.ndarray:
    """scikit-learn's sign convention: each row's entry of largest absolute value is positive."""
    biggest = np.argmax(np.abs(components), axis=1)
    signs = np.sign(components[np.arange(len(components)), biggest])
    signs[signs == 0] = 1.0
    return components * signs[:, None]


def _spectrum(shards: Shards, solver: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean; squared singular values, descending; right singular vectors as rows) of X - mean over every block.

    "covariance_eigh": one pass, one reduction of (sum x, X^T X), then X^T X - n m m^T (as scikit-learn; the
    subtraction loses relative accuracy in the small eigenvalues when the mean is large beside the spread).
    "tsqr": the mean first, then R factors of X - mean: no squaring, no cancellation.
    """
    n = shards.n_samples
    if solver in ("full", "tsqr"):
        mean = shards.reduce(_sums)[0] / n
        factors = [r for r in shards.gather(_local_r, mean) if r.shape[0]]
        R = scipy.linalg.qr(np.vstack(factors), mode="r", check_finite=False)[0]
        _, s, Vt = scipy.linalg.svd(R, full_matrices=False, check_finite=False)
        d = mean.shape[0]
        s2 = np.zeros(d)
        s2[: len(s)] = s**2
        V = np.zeros((d, d))
        V[: Vt.shape[0]] = Vt
        if Vt.shape[0] < d:  # fewer rows than features: complete the basis (zero singular values)
            V[Vt.shape[0] :] = scipy.linalg.null_space(Vt).T
        return mean, s2, V
    sums, G = shards.reduce(_moments)
    mean = sums / n
    G -= n * np.outer(mean, mean)
    values, vectors = scipy.linalg.eigh(G, check_finite=False)
    return mean, np.maximum(values[::-1], 0.0), vectors[:, ::-1].T


class _Decomposition(DistributedMixin, ClassNamePrefixFeaturesOutMixin, TransformerMixin, BaseEstimator):
    n_components: Any
    components_: np.ndarray

    def transform(self, X: Any) -> Any:
        """Coordinates of X's rows on the components (local rows with `comm`; lazy for a Dask array)."""
        self._check_fitted("components_")
        Xv = self._check_predict_input(X, (np.float64, np.float32))
        return self._rows(Xv, _project, self._offset(), self.components_, self._scale(), len(self.components_))

    def fit_transform(self, X: Any, y: Any = None) -> Any:
        return self.fit(X).transform(X)

    def _scale(self) -> Any:
        return None

    def _offset(self) -> np.ndarray:
        return self.mean_

    def _rows(self, X: Any, fn: Any, *args: Any) -> Any:
        *rest, width = args
        dtype = X.dtype
        if is_dask_array(X):
            from hpdl.ml.dask_backend import map_rows

            return map_rows(X, fn, *rest, dtype=dtype, tail=(width,))
        return fn((X,), (0, 0), *rest)

    def __sklearn_tags__(self) -> Any:
        tags = super().__sklearn_tags__()
        tags.input_tags.sparse = False
        tags.transformer_tags.preserves_dtype = ["float64", "float32"]
        return tags


class PCA(_Decomposition):
    """Principal component analysis like scikit-learn's, from the reduced covariance (or TSQR).

    `n_components`: None (all), an int, a float in (0, 1) (the fewest
    components that explain more than that share of the variance), or
    "mle" (Minka's estimate, scikit-learn's). `whiten` scales the
    coordinates to unit variance. `comm`: every rank passes its rows.
    """

    _parameter_constraints: dict = {
        "n_components": [
            Interval(Integral, 0, None, closed="left"),
            Interval(RealNotInt, 0, 1, closed="neither"),
            StrOptions({"mle"}),
            None,
        ],
        "copy": ["boolean"],
        "whiten": ["boolean"],
        "svd_solver": [StrOptions({"auto", "covariance_eigh", "full", "tsqr", "arpack", "randomized"})],
        "tol": [Interval(Real, 0, None, closed="left")],
        "iterated_power": [StrOptions({"auto"}), Interval(Integral, 0, None, closed="left")],
        "n_oversamples": [Interval(Integral, 1, None, closed="left")],
        "power_iteration_normalizer": [StrOptions({"auto", "QR", "LU", "none"})],
        "random_state": ["random_state"],
        "comm": "no_validation",
    }

    def __init__(
        self,
        n_components: Any = None,
        *,
        copy: bool = True,
        whiten: bool = False,
        svd_solver: str = "auto",
        tol: float = 0.0,
        iterated_power: Any = "auto",
        n_oversamples: int = 10,
        power_iteration_normalizer: str = "auto",
        random_state: Any = None,
        comm: Any = None,
    ):
        self.n_components = n_components
        self.copy = copy
        self.whiten = whiten
        self.svd_solver = svd_solver
        self.tol = tol
        self.iterated_power = iterated_power
        self.n_oversamples = n_oversamples
        self.power_iteration_normalizer = power_iteration_normalizer
        self.random_state = random_state
        self.comm = comm

    def fit(self, X: Any, y: Any = None) -> PCA:
        """Fit on X (an array, this rank's shard with `comm`, or a Dask array).

        "arpack" and "randomized" are accepted for compatibility and solved
        exactly (by "covariance_eigh"); "full" and "tsqr" use TSQR.
        """
        self._validate_params()
        shards = self._shards(X)
        n, d = shards.n_samples, shards.n_features
        if n < 2 and self.n_components != 0:
            raise ValueError(f"PCA needs at least 2 samples to estimate a covariance, got n_samples={n}")
        nc = self._count(n, d)
        mean, s2, V = _spectrum(shards, "full" if self.svd_solver in ("full", "tsqr") else "covariance_eigh")
        rank = min(n, d)
        variance = s2[:rank] / (n - 1)
        total = variance.sum()
        ratio = variance / total if total > 0 else np.zeros_like(variance)
        if self.n_components == "mle":
            nc = int(_infer_dimension(variance, n))
        elif isinstance(self.n_components, float):
            nc = int(np.searchsorted(np.cumsum(ratio), self.n_components, side="right") + 1)
            nc = min(nc, rank)
        dtype = shards.dtype
        self.components_ = _flip(V[:nc]).astype(dtype)
        self.explained_variance_ = variance[:nc].astype(dtype)
        self.explained_variance_ratio_ = ratio[:nc].astype(dtype)
        self.singular_values_ = np.sqrt(s2[:nc]).astype(dtype)
        self.mean_ = mean.astype(dtype)
        self.n_components_ = nc
        self.n_samples_ = n
        self.noise_variance_ = float(variance[nc:].mean()) if nc < rank else 0.0
        self._n_features_out = nc
        return self

    def _count(self, n: int, d: int) -> int:
        nc = self.n_components
        if nc is None:
            return min(n, d)
        if isinstance(nc, str):
            if n < d:
                raise ValueError("n_components='mle' is only supported if n_samples >= n_features")
            return d
        if isinstance(nc, Integral) and int(nc) > min(n, d):
            raise ValueError(
                f"n_components={nc} must be between 0 and min(n_samples, n_features)={min(n, d)} with "
                "svd_solver='covariance_eigh'"
            )
        return int(nc) if isinstance(nc, Integral) else d

    def _scale(self) -> Any:
        return np.sqrt(self.explained_variance_) if self.whiten else None

    def inverse_transform(self, X: Any) -> Any:
        """Rows back in the input space (local; lazy for a Dask array)."""
        self._check_fitted("components_")
        C = self.components_
        if self.whiten:
            C = C * np.sqrt(self.explained_variance_)[:, None]
        if is_dask_array(X):
            return X @ C + self.mean_
        return np.asarray(X) @ C + self.mean_

    def get_covariance(self) -> np.ndarray:
        """The model's covariance: components_ scaled by their variance, plus the noise variance."""
        self._check_fitted("components_")
        C = self.components_
        ev = self.explained_variance_
        if self.whiten:
            C = C * np.sqrt(ev)[:, None]
        excess = np.maximum(ev - self.noise_variance_, 0.0)
        cov = (C.T * (excess / np.where(ev > 0, ev, 1) if self.whiten else excess)) @ C
        cov.flat[:: len(cov) + 1] += self.noise_variance_
        return cov


class TruncatedSVD(_Decomposition):
    """The top right singular vectors of X (no centring) like scikit-learn's, solved exactly from X^T X.

    `algorithm` ("randomized" or "arpack") is accepted for compatibility:
    the reduced d x d Gram matrix is decomposed exactly, so the result is
    what "arpack" converges to.
    """

    _parameter_constraints: dict = {
        "n_components": [Interval(Integral, 1, None, closed="left")],
        "algorithm": [StrOptions({"arpack", "randomized"})],
        "n_iter": [Interval(Integral, 0, None, closed="left")],
        "n_oversamples": [Interval(Integral, 1, None, closed="left")],
        "power_iteration_normalizer": [StrOptions({"auto", "OR", "QR", "LU", "none"})],
        "random_state": ["random_state"],
        "tol": [Interval(Real, 0, None, closed="left")],
        "comm": "no_validation",
    }

    def __init__(
        self,
        n_components: int = 2,
        *,
        algorithm: str = "randomized",
        n_iter: int = 5,
        n_oversamples: int = 10,
        power_iteration_normalizer: str = "auto",
        random_state: Any = None,
        tol: float = 0.0,
        comm: Any = None,
    ):
        self.n_components = n_components
        self.algorithm = algorithm
        self.n_iter = n_iter
        self.n_oversamples = n_oversamples
        self.power_iteration_normalizer = power_iteration_normalizer
        self.random_state = random_state
        self.tol = tol
        self.comm = comm

    def fit(self, X: Any, y: Any = None) -> TruncatedSVD:
        """Fit on X (an array, this rank's shard with `comm`, or a Dask array)."""
        self._validate_params()
        shards = self._shards(X)
        n, d = shards.n_samples, shards.n_features
        nc = self.n_components
        if nc > d:
            raise ValueError(f"n_components({nc}) must be <= n_features({d}).")
        sums, G = shards.reduce(_moments)
        mean = sums / n
        values, vectors = scipy.linalg.eigh(G, check_finite=False)
        order = np.argsort(values)[::-1][:nc]
        V = _flip(vectors[:, order].T)
        centred = G / n - np.outer(mean, mean)  # the biased covariance (np.var's ddof=0)
        variance = np.einsum("ij,jk,ik->i", V, centred, V)
        total = float(np.trace(centred))
        dtype = shards.dtype
        self.components_ = V.astype(dtype)
        self.singular_values_ = np.sqrt(np.maximum(values[order], 0.0)).astype(dtype)
        self.explained_variance_ = variance.astype(dtype)
        self.explained_variance_ratio_ = (variance / total if total > 0 else np.zeros(nc)).astype(dtype)
        self._n_features_out = nc
        return self

    def _offset(self) -> np.ndarray:
        return np.zeros(self.components_.shape[1], dtype=self.components_.dtype)

    def inverse_transform(self, X: Any) -> Any:
        self._check_fitted("components_")
        return X @ self.components_
