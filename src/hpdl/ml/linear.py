"""Least squares and ridge regression from reduced moments: one process, SPMD ranks or Dask, same answer.

Two passes over the data: weighted means (sum w, sum w x, sum w y), then
either the centred normal equations X^T W X and X^T W y accumulated in
float64 ("normal", the default: one reduction of a d x d matrix), or TSQR
("tsqr", for ill-conditioned data: each block's R factor of
sqrt(w) [X - mean, y - mean], gathered and factorised again; the normal
equations square the condition number, TSQR does not). Centring on the
weighted means before accumulating is what scikit-learn's
`_preprocess_data` does, so intercept and coefficients agree with it.
"""

from __future__ import annotations

from numbers import Real
from typing import Any

import numpy as np
import scipy.linalg
from sklearn.base import BaseEstimator, MultiOutputMixin, RegressorMixin
from sklearn.metrics import r2_score
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.validation import check_array, check_consistent_length

from hpdl.ml import kernels
from hpdl.ml.base import Shards, is_dask_array
from hpdl.ml.estimator import DistributedMixin, check_weights

__all__ = ["LinearRegression", "Ridge"]


# --------------------------------------------------------------------------- block functions
def _moments(block: tuple, meta: Any) -> tuple:
    X, y, w = block
    if w is None:
        return float(X.shape[0]), X.sum(0, dtype=np.float64), y.sum(0, dtype=np.float64)
    w64 = np.asarray(w, dtype=np.float64)
    return w64.sum(), w64 @ X.astype(np.float64, copy=False), w64 @ y.astype(np.float64, copy=False)


def _gram(block: tuple, meta: Any, x_mean: np.ndarray, y_mean: np.ndarray) -> tuple:
    X, y, w = block
    return kernels.gram_partial(X, y, w, x_mean, y_mean)


def _local_r(block: tuple, meta: Any, x_mean: np.ndarray, y_mean: np.ndarray) -> np.ndarray:
    """R of the block's QR of sqrt(w) [X - x_mean, y - y_mean] (at most d + t rows)."""
    X, y, w = block
    A = np.hstack([np.asarray(X, np.float64) - x_mean, np.asarray(y, np.float64) - y_mean])
    if w is not None:
        A *= np.sqrt(np.asarray(w, np.float64))[:, None]
    if A.shape[0] == 0:
        return np.zeros((0, A.shape[1]))
    return scipy.linalg.qr(A, mode="r", check_finite=False)[0][: A.shape[1]]


def _residuals(block: tuple, meta: Any, coef: np.ndarray, intercept: np.ndarray, y_mean: np.ndarray) -> tuple:
    X, y, w = block
    pred = np.asarray(X, np.float64) @ coef.T + intercept
    res = (np.asarray(y, np.float64) - pred) ** 2
    tot = (np.asarray(y, np.float64) - y_mean) ** 2
    if w is not None:
        w64 = np.asarray(w, np.float64)[:, None]
        res, tot = res * w64, tot * w64
    return res.sum(0), tot.sum(0)


def _predict_block(block: tuple, meta: Any, coef: np.ndarray, intercept: Any) -> np.ndarray:
    X = block[0]
    return X @ coef.T + intercept


# --------------------------------------------------------------------------- shared fit
class _LinearBase(DistributedMixin, MultiOutputMixin, RegressorMixin, BaseEstimator):
    fit_intercept: bool
    solver: str

    def _alpha(self, n_targets: int) -> np.ndarray:
        return np.zeros(n_targets)

    def _xy_shards(self, X: Any, y: Any, sample_weight: Any) -> tuple[Shards, bool]:
        if is_dask_array(X):
            if y is None:
                raise ValueError("requires y to be passed, but the target y is None")
            one_d = y.ndim == 1
            if one_d:
                y = y.reshape(-1, 1)
            return self._shards(X, [y, sample_weight]), one_d

        shape: list[bool] = []  # y's dimensionality, read after validation (an array-like may refuse np.ndim)

        def check(Xv: np.ndarray, extra: list) -> list:
            yv, sw = extra
            if yv is None:
                raise ValueError("requires y to be passed, but the target y is None")
            yv = check_array(yv, ensure_2d=False, dtype=np.float64, ensure_min_samples=0, input_name="y")
            check_consistent_length(Xv, yv)
            if sw is not None:
                sw = check_weights(sw, Xv, np.float64)
            shape.append(yv.ndim == 1)
            return [yv[:, None] if yv.ndim == 1 else yv, sw]

        shards = self._shards(X, [y, sample_weight], check=check)
        one_d = shape[0] if shape else True
        return shards, one_d

    def fit(self, X: Any, y: Any, sample_weight: Any = None) -> Any:
        """Fit on X, y (arrays; this rank's rows with `comm`; or Dask arrays)."""
        self._validate_params()
        if getattr(self, "positive", False):
            raise ValueError(
                f"{type(self).__name__}(positive=True) is not supported by hpdl.ml (it needs an iterative NNLS "
                "solver); use scikit-learn's estimator for positive coefficients"
            )
        shards, one_d = self._xy_shards(X, y, sample_weight)
        total, sum_x, sum_y = shards.reduce(_moments)
        n_targets = sum_y.shape[0]
        if self.fit_intercept:
            if total <= 0:
                raise ValueError("the sample weights sum to 0: no sample carries weight")
            x_mean, y_mean = sum_x / total, sum_y / total
        else:
            x_mean, y_mean = np.zeros_like(sum_x), np.zeros_like(sum_y)
        alpha = self._alpha(n_targets)
        if self.solver == "tsqr":
            coef = self._solve_tsqr(shards, x_mean, y_mean, alpha)
        else:
            G, b = shards.reduce(_gram, x_mean, y_mean)
            coef = self._solve_normal(G, b, alpha)
        intercept = y_mean - x_mean @ coef.T if self.fit_intercept else np.zeros(n_targets)
        if isinstance(self, Ridge):
            self.n_iter_ = np.ones(n_targets, dtype=np.int32)  # one direct solve per target
        self.coef_ = coef[0] if one_d else coef
        self.intercept_ = float(intercept[0]) if one_d else intercept
        return self

    def _solve_normal(self, G: np.ndarray, b: np.ndarray, alpha: np.ndarray) -> np.ndarray:
        """Coefficients (n_targets, n_features) from the centred Gram matrix."""
        d = G.shape[0]
        if not np.any(alpha):
            return np.linalg.lstsq(G, b, rcond=None)[0].T  # minimum-norm, like scipy's lstsq on X itself
        out = np.empty((b.shape[1], d))
        for j, a in enumerate(alpha):
            out[j] = scipy.linalg.solve(G + a * np.eye(d), b[:, j], assume_a="pos")
        return out

    def _solve_tsqr(self, shards: Shards, x_mean: np.ndarray, y_mean: np.ndarray, alpha: np.ndarray) -> np.ndarray:
        d = x_mean.shape[0]
        factors = [r for r in shards.gather(_local_r, x_mean, y_mean) if r.shape[0]]
        out = np.empty((y_mean.shape[0], d))
        for j, a in enumerate(alpha):
            stack = [np.hstack([f[:, :d], f[:, d + j : d + j + 1]]) for f in factors]
            if a:
                stack.append(np.hstack([np.sqrt(a) * np.eye(d), np.zeros((d, 1))]))
            R = scipy.linalg.qr(np.vstack(stack), mode="r", check_finite=False)[0]
            rows = min(R.shape[0], d)
            out[j] = scipy.linalg.lstsq(R[:rows, :d], R[:rows, d], check_finite=False)[0]
        return out

    def predict(self, X: Any) -> Any:
        """X @ coef_.T + intercept_ (local rows with `comm`; lazy for a Dask array)."""
        self._check_fitted("coef_")
        X = self._check_predict_input(X, (np.float64, np.float32))
        coef = np.atleast_2d(self.coef_)
        intercept = np.atleast_1d(self.intercept_)
        if is_dask_array(X):
            from hpdl.ml.dask_backend import map_rows

            out = map_rows(X, _predict_block, coef, intercept, dtype=np.float64, tail=(coef.shape[0],))
        else:
            out = _predict_block((X,), (0, 0), coef, intercept)
        return out[:, 0] if np.ndim(self.coef_) == 1 else out

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """R^2 over all rows (every rank's with `comm`), averaged uniformly over targets like scikit-learn's."""
        self._check_fitted("coef_")
        if not is_dask_array(X) and (self.comm is None or self.comm.size == 1):
            return float(r2_score(y, self.predict(X), sample_weight=sample_weight))
        fitted = self.n_features_in_
        shards, _ = self._xy_shards(X, y, sample_weight)
        self.n_features_in_ = fitted
        if shards.n_features != fitted:
            raise ValueError(f"X has {shards.n_features} features, but the model expects {fitted}")
        total, _, sum_y = shards.reduce(_moments)
        coef = np.atleast_2d(self.coef_)
        res, tot = shards.reduce(_residuals, coef, np.atleast_1d(self.intercept_), sum_y / total)
        with np.errstate(divide="ignore", invalid="ignore"):
            r2 = np.where(tot > 0, 1 - res / tot, np.where(res > 0, 0.0, 1.0))
        return float(np.mean(r2))


class LinearRegression(_LinearBase):
    """Ordinary least squares like scikit-learn's, solved from reduced moments ("normal") or by TSQR.

    `solver="tsqr"` avoids squaring the condition number (for nearly
    collinear features). `comm`: every rank passes its rows of X and y.
    """

    _parameter_constraints: dict = {
        "fit_intercept": ["boolean"],
        "copy_X": ["boolean"],
        "tol": [Interval(Real, 0, None, closed="left")],
        "n_jobs": "no_validation",
        "positive": ["boolean"],
        "solver": [StrOptions({"normal", "tsqr"})],
        "comm": "no_validation",
    }

    def __init__(
        self,
        *,
        fit_intercept: bool = True,
        copy_X: bool = True,
        tol: float = 1e-6,
        n_jobs: Any = None,
        positive: bool = False,
        solver: str = "normal",
        comm: Any = None,
    ):
        self.fit_intercept = fit_intercept
        self.copy_X = copy_X
        self.tol = tol
        self.n_jobs = n_jobs
        self.positive = positive
        self.solver = solver
        self.comm = comm


class Ridge(_LinearBase):
    """Ridge regression (L2 penalty `alpha`, one value or one per target) like scikit-learn's.

    `solver`: "auto"/"cholesky" solve (X^T W X + alpha I) b = X^T W y; "tsqr"
    factorises [sqrt(W) X; sqrt(alpha) I] instead.
    """

    _parameter_constraints: dict = {
        "alpha": [Interval(Real, 0, None, closed="left"), "array-like"],
        "fit_intercept": ["boolean"],
        "copy_X": ["boolean"],
        "max_iter": "no_validation",
        "tol": [Interval(Real, 0, None, closed="left")],
        "solver": [StrOptions({"auto", "cholesky", "tsqr"})],
        "positive": ["boolean"],
        "random_state": ["random_state"],
        "comm": "no_validation",
    }

    def __init__(
        self,
        alpha: Any = 1.0,
        *,
        fit_intercept: bool = True,
        copy_X: bool = True,
        max_iter: Any = None,
        tol: float = 1e-4,
        solver: str = "auto",
        positive: bool = False,
        random_state: Any = None,
        comm: Any = None,
    ):
        self.alpha = alpha
        self.fit_intercept = fit_intercept
        self.copy_X = copy_X
        self.max_iter = max_iter
        self.tol = tol
        self.solver = solver
        self.positive = positive
        self.random_state = random_state
        self.comm = comm

    def _alpha(self, n_targets: int) -> np.ndarray:
        alpha = np.asarray(self.alpha, dtype=np.float64).ravel()
        if alpha.size == 1:
            return np.full(n_targets, float(alpha[0]))
        if alpha.size != n_targets or (alpha < 0).any():
            raise ValueError(
                f"Number of targets and number of penalties do not correspond: {alpha.size} != {n_targets} "
                "(alpha must be one non-negative value or one per target)"
            )
        return alpha
