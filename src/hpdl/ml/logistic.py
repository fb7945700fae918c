"""Logistic regression (binary and multinomial, L2) with scikit-learn's API: one process, SPMD ranks or Dask.

Every rank runs the same L-BFGS (scipy.optimize) on the same objective: the
loss and its gradient are sums over rows, so each evaluation is one
reduction of (loss, gradient) over the blocks (one allreduce on MPI, one
Dask compute). The objective is scikit-learn's:

    sum_i s_i loss_i / sum_i s_i + ||W||^2 / (2 C sum_i s_i)

(s = sample_weight x class weight; the intercept is not penalised), so the
minimiser is the same. With `comm`, rank 0's reduced values are broadcast
after every reduction, so every rank's optimiser sees bit-identical numbers
and takes the same steps (the number of collectives never differs between
ranks, whatever the MPI library's rounding).
"""

from __future__ import annotations

import inspect
import warnings
from numbers import Integral, Real
from typing import Any

import numpy as np
import scipy.optimize
from scipy.special import expit, log_expit, logsumexp
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.exceptions import ConvergenceWarning
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.class_weight import compute_class_weight
from sklearn.utils.validation import check_array, check_consistent_length, column_or_1d

from hpdl.ml.base import Shards, is_dask_array
from hpdl.ml.estimator import DistributedMixin, check_weights
from hpdl.ml.targets import global_classes

__all__ = ["LogisticRegression"]

ROWS_PER_CHUNK = 8192
BALANCED_BY_WEIGHT = "sample_weight" in inspect.signature(compute_class_weight).parameters
"""Whether class_weight="balanced" counts the rows of a class by their sample weights, as scikit-learn does from
1.7 (scikit-learn#30057); before, it counted rows. hpdl follows the installed scikit-learn."""


# --------------------------------------------------------------------------- block functions
def _class_totals(block: tuple, meta: Any, n_classes: int, weighted: bool) -> tuple:
    """Row count per class (for class_weight="balanced"), each row counted by its sample weight if `weighted`."""
    _, codes, w = block
    weights = np.asarray(w, np.float64) if weighted and w is not None else None
    counts = np.bincount(codes, weights=weights, minlength=n_classes)
    return (counts.astype(np.float64),)


def _loss_grad(block: tuple, meta: Any, W: np.ndarray, b: np.ndarray, class_w: np.ndarray, binary: bool) -> tuple:
    """(sum s_i loss_i, dL/dW, dL/db, sum s_i) of one block, in float64, chunk by chunk."""
    X, codes, w = block
    loss = 0.0
    gW = np.zeros_like(W)
    gb = np.zeros_like(b)
    total = 0.0
    for s in range(0, X.shape[0], ROWS_PER_CHUNK):
        x = np.asarray(X[s : s + ROWS_PER_CHUNK], dtype=np.float64)
        c = codes[s : s + ROWS_PER_CHUNK]
        sw = class_w[c]
        if w is not None:
            sw = sw * np.asarray(w[s : s + ROWS_PER_CHUNK], dtype=np.float64)
        z = x @ W.T + b
        if binary:
            y = (c == 1).astype(np.float64)
            zz = z[:, 0]
            loss += float(sw @ (-log_expit(zz) * y - log_expit(-zz) * (1 - y)))
            g = (expit(zz) - y) * sw
            gW[0] += g @ x
            gb[0] += g.sum()
        else:
            lse = logsumexp(z, axis=1)
            loss += float(sw @ (lse - z[np.arange(len(c)), c]))
            p = np.exp(z - lse[:, None])
            p[np.arange(len(c)), c] -= 1.0
            p *= sw[:, None]
            gW += p.T @ x
            gb += p.sum(0)
        total += float(sw.sum())
    return loss, gW, gb, total


def _decision_block(block: tuple, meta: Any, coef: np.ndarray, intercept: np.ndarray) -> np.ndarray:
    return np.asarray(block[0], dtype=np.float64) @ coef.T + intercept


class LogisticRegression(DistributedMixin, ClassifierMixin, BaseEstimator):
    """L2-penalised logistic regression (L-BFGS on reduced gradients) like scikit-learn's.

    Two classes: one coefficient row (the logistic loss); more: one row per
    class (the multinomial loss). `comm`: every rank passes its rows of X
    and y and ends with the same model; `score` is the accuracy over every
    rank's rows. A Dask array runs on the current Client.
    """

    coef_: np.ndarray
    intercept_: np.ndarray

    _parameter_constraints: dict = {
        "penalty": [StrOptions({"l2", "deprecated"}), None],
        "C": [Interval(Real, 0, None, closed="right")],
        "l1_ratio": [Interval(Real, 0, 1, closed="both"), None],
        "dual": ["boolean"],
        "tol": [Interval(Real, 0, None, closed="left")],
        "fit_intercept": ["boolean"],
        "intercept_scaling": [Interval(Real, 0, None, closed="neither")],
        "class_weight": [dict, StrOptions({"balanced"}), None],
        "random_state": ["random_state"],
        "solver": [StrOptions({"lbfgs"})],
        "max_iter": [Interval(Integral, 0, None, closed="left")],
        "verbose": ["verbose"],
        "warm_start": ["boolean"],
        "n_jobs": [None, Integral],
        "comm": "no_validation",
    }

    def __init__(
        self,
        penalty: Any = "deprecated",
        *,
        C: float = 1.0,
        l1_ratio: float = 0.0,
        dual: bool = False,
        tol: float = 1e-4,
        fit_intercept: bool = True,
        intercept_scaling: float = 1,
        class_weight: Any = None,
        random_state: Any = None,
        solver: str = "lbfgs",
        max_iter: int = 100,
        verbose: int = 0,
        warm_start: bool = False,
        n_jobs: Any = None,
        comm: Any = None,
    ):
        self.penalty = penalty
        self.C = C
        self.l1_ratio = l1_ratio
        self.dual = dual
        self.tol = tol
        self.fit_intercept = fit_intercept
        self.intercept_scaling = intercept_scaling
        self.class_weight = class_weight
        self.random_state = random_state
        self.solver = solver
        self.max_iter = max_iter
        self.verbose = verbose
        self.warm_start = warm_start
        self.n_jobs = n_jobs
        self.comm = comm

    def fit(self, X: Any, y: Any, sample_weight: Any = None) -> LogisticRegression:
        """Fit on X, y (arrays; this rank's rows with `comm`; or Dask arrays)."""
        self._validate_params()
        if self.l1_ratio:
            raise ValueError(f"l1_ratio={self.l1_ratio}: hpdl.ml's LogisticRegression has the L2 penalty only (0)")
        if self.dual:
            raise ValueError("LogisticRegression(dual=True) needs liblinear; hpdl.ml solves the primal with lbfgs")
        self.classes_ = global_classes(y, self.comm)
        if len(self.classes_) < 2:
            raise ValueError(
                "This solver needs samples of at least 2 classes in the data, but the data contains only one "
                f"class: {self.classes_[0] if len(self.classes_) else None}"
            )
        shards = self._labelled_shards(X, y, sample_weight)
        n_classes = len(self.classes_)
        binary = n_classes == 2
        class_w = self._class_weights(shards, n_classes)
        rows = 1 if binary else n_classes
        d = shards.n_features
        penalised = self.penalty is not None and np.isfinite(self.C)
        comm = getattr(shards, "comm", None)

        def objective(theta: np.ndarray) -> tuple[float, np.ndarray]:
            W = theta[: rows * d].reshape(rows, d)
            b = theta[rows * d :] if self.fit_intercept else np.zeros(rows)
            loss, gW, gb, total = shards.reduce(_loss_grad, W, b, class_w, binary)
            packed = np.concatenate([[float(loss), float(total)], gW.ravel(), np.atleast_1d(gb)])
            if comm is not None:  # bit-identical values on every rank: the same optimiser steps everywhere
                comm.broadcast(packed, root=0)
            loss, total = packed[0], packed[1]
            gW = packed[2 : 2 + rows * d].reshape(rows, d)
            gb = packed[2 + rows * d :]
            if total <= 0:
                raise ValueError("the sample weights sum to 0: no sample carries weight")
            value = loss / total
            grad_w = gW / total
            if penalised:
                value += float((W * W).sum()) / (2.0 * self.C * total)
                grad_w = grad_w + W / (self.C * total)
            grad = np.concatenate([grad_w.ravel(), gb / total]) if self.fit_intercept else grad_w.ravel()
            return float(value), grad

        theta0 = np.zeros(rows * d + (rows if self.fit_intercept else 0))
        if self.warm_start and hasattr(self, "coef_") and self.coef_.shape == (rows, d):
            theta0[: rows * d] = self.coef_.ravel()
            if self.fit_intercept:
                theta0[rows * d :] = self.intercept_
        result = scipy.optimize.minimize(
            objective,
            theta0,
            method="L-BFGS-B",
            jac=True,
            options={"maxiter": self.max_iter, "maxls": 50, "gtol": self.tol, "ftol": 64 * np.finfo(float).eps},
        )
        if not result.success and self.max_iter > 0 and result.nit >= self.max_iter:
            warnings.warn(
                f"lbfgs failed to converge after {result.nit} iteration(s) (status={result.status}); increase "
                "max_iter or scale the data",
                ConvergenceWarning,
                stacklevel=2,
            )
        theta = result.x
        self.coef_ = theta[: rows * d].reshape(rows, d)
        self.intercept_ = theta[rows * d :] if self.fit_intercept else np.zeros(rows)
        self.n_iter_ = np.array([int(result.nit)], dtype=np.int32)
        return self

    def _labelled_shards(self, X: Any, y: Any, sample_weight: Any) -> Shards:
        classes = self.classes_
        if is_dask_array(X):
            import dask.array as da

            yd = y if is_dask_array(y) else da.from_array(np.asarray(y))
            codes = yd.map_blocks(lambda b: np.searchsorted(classes, np.asarray(b).ravel()), dtype=np.int64)
            return self._shards(X, [codes, sample_weight])

        def check(Xv: np.ndarray, extra: list) -> list:
            yv, sw = extra
            yv = column_or_1d(
                check_array(yv, ensure_2d=False, dtype=None, ensure_min_samples=0, input_name="y"), warn=True
            )
            check_consistent_length(Xv, yv)
            if sw is not None:
                sw = check_weights(sw, Xv, np.float64)
            return [np.searchsorted(classes, yv).astype(np.int64), sw]

        return self._shards(X, [y, sample_weight], check=check)

    def _class_weights(self, shards: Shards, n_classes: int) -> np.ndarray:
        cw = self.class_weight
        if cw is None:
            return np.ones(n_classes)
        if cw == "balanced":
            counts = shards.reduce(_class_totals, n_classes, BALANCED_BY_WEIGHT)[0]
            with np.errstate(divide="ignore"):
                return np.where(counts > 0, counts.sum() / (n_classes * counts), 0.0)
        out = np.ones(n_classes)
        for label, weight in cw.items():
            position = np.searchsorted(self.classes_, label)
            if position >= n_classes or self.classes_[position] != label:
                raise ValueError(f"The classes, {[label]}, are not in class, {list(self.classes_)}")
            out[position] = weight
        return out

    # ------------------------------------------------------------------ use
    def decision_function(self, X: Any) -> Any:
        """X @ coef_.T + intercept_ (1-D for two classes), for local rows (lazy for a Dask array)."""
        self._check_fitted("coef_")
        Xv = self._check_predict_input(X, (np.float64, np.float32))
        if is_dask_array(Xv):
            from hpdl.ml.dask_backend import map_rows

            out = map_rows(
                Xv, _decision_block, self.coef_, self.intercept_, dtype=np.float64, tail=(self.coef_.shape[0],)
            )
        else:
            out = _decision_block((Xv,), (0, 0), self.coef_, self.intercept_)
        return out[:, 0] if self.coef_.shape[0] == 1 else out

    def predict_proba(self, X: Any) -> Any:
        z = self.decision_function(X)
        if is_dask_array(z):
            return z.map_blocks(
                _proba,
                self.coef_.shape[0] == 1,
                dtype=np.float64,
                chunks=(z.chunks[0], (len(self.classes_),)),
                new_axis=1 if z.ndim == 1 else None,
            )
        return _proba(z, self.coef_.shape[0] == 1)

    def predict_log_proba(self, X: Any) -> Any:
        return np.log(self.predict_proba(X))

    def predict(self, X: Any) -> Any:
        z = self.decision_function(X)
        if is_dask_array(z):
            return z.map_blocks(_labels, self.classes_, dtype=self.classes_.dtype, drop_axis=1 if z.ndim == 2 else None)
        return _labels(z, self.classes_)

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """Accuracy (over every rank's rows with `comm`)."""
        pred = self.predict(X)
        if is_dask_array(pred):
            pred = pred.compute()
            y = y.compute() if is_dask_array(y) else y
        y = column_or_1d(np.asarray(y))
        w = np.ones(len(y)) if sample_weight is None else np.asarray(sample_weight, np.float64)
        sums = np.array([float(np.dot(w, pred == y)), float(w.sum())])
        if self.comm is not None and self.comm.size > 1:
            self.comm.allreduce(sums)
        return float(sums[0] / sums[1]) if sums[1] else 0.0


def _proba(z: np.ndarray, binary: bool) -> np.ndarray:
    if binary:
        p = expit(np.asarray(z).ravel())
        return np.column_stack([1 - p, p])
    return np.exp(z - logsumexp(z, axis=1, keepdims=True))


def _labels(z: np.ndarray, classes: np.ndarray) -> np.ndarray:
    if z.ndim == 1:
        return classes[(z > 0).astype(np.int64)]
    return classes[np.argmax(z, axis=1)]
