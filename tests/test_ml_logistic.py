"""hpdl.ml.LogisticRegression equals scikit-learn's (one process) and one process's fit (MPI ranks).

Both libraries minimise the same strictly convex objective, so with a tight
`tol` both reach its unique minimum and differ only by where each optimiser
stops: coefficients agree to 1e-4 relative to their largest entry and
probabilities to 1e-5, whatever the BLAS kernel. On ranks every evaluation
reduces float64 sums in another order, so ranks agree with one process to
the same tolerance, and every rank holds the same model exactly (rank 0's
reductions are broadcast).
"""

from __future__ import annotations

import numpy as np
import pytest
import sklearn.linear_model
from sklearn.datasets import load_breast_cancer, load_digits, load_iris, load_wine
from sklearn.preprocessing import StandardScaler

from hpdl.ml import LogisticRegression, logistic
from ml_shards import bounds, first_ranks

TIGHT = {"tol": 1e-10, "max_iter": 5000}
COEF_RTOL = 1e-4
PROBA_ATOL = 1e-5

DATA = {"iris": load_iris, "digits": load_digits, "wine": load_wine, "breast_cancer": load_breast_cancer}


def _data(name: str, rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    X, y = DATA[name](return_X_y=True)
    if rows is not None:
        X, y = X[:rows], y[:rows]
    return StandardScaler().fit_transform(X), y


def _close(ours, theirs, X) -> None:
    scale = np.abs(theirs.coef_).max()
    np.testing.assert_allclose(ours.coef_, theirs.coef_, atol=COEF_RTOL * scale, rtol=0)
    np.testing.assert_allclose(ours.intercept_, theirs.intercept_, atol=COEF_RTOL * max(scale, 1.0), rtol=0)
    np.testing.assert_allclose(ours.predict_proba(X), theirs.predict_proba(X), atol=PROBA_ATOL)
    assert ours.coef_.shape == theirs.coef_.shape and ours.intercept_.shape == theirs.intercept_.shape


CASES = [
    ("iris", {"C": 1.0}),
    ("wine", {"C": 0.3, "class_weight": "balanced"}),
    ("breast_cancer", {"C": 2.0}),
    ("breast_cancer", {"C": 0.5, "fit_intercept": False, "class_weight": {0: 2.0, 1: 0.5}}),
    ("digits", {"C": 0.1}),
]


@pytest.mark.parametrize("name, kwargs", CASES)
def test_logistic_matches_sklearn(name, kwargs):
    X, y = _data(name, 600 if name == "digits" else None)
    ours = LogisticRegression(**kwargs, **TIGHT).fit(X, y)
    theirs = sklearn.linear_model.LogisticRegression(**kwargs, **TIGHT).fit(X, y)
    _close(ours, theirs, X)
    np.testing.assert_array_equal(ours.classes_, theirs.classes_)
    assert ours.score(X, y) == pytest.approx(theirs.score(X, y), abs=1.5 / len(y))


def test_logistic_sample_weight_and_string_labels():
    X, y = _data("iris")
    w = np.random.default_rng(0).uniform(0.5, 2.0, len(y))
    labels = np.array(["setosa", "versicolor", "virginica"])[y]
    ours = LogisticRegression(C=0.7, **TIGHT).fit(X, labels, sample_weight=w)
    theirs = sklearn.linear_model.LogisticRegression(C=0.7, **TIGHT).fit(X, labels, sample_weight=w)
    _close(ours, theirs, X)
    np.testing.assert_array_equal(ours.predict(X), theirs.predict(X))
    binary = y > 0  # two classes: one coefficient row, the logistic loss
    ours = LogisticRegression(**TIGHT).fit(X, binary)
    theirs = sklearn.linear_model.LogisticRegression(**TIGHT).fit(X, binary)
    _close(ours, theirs, X)
    np.testing.assert_allclose(ours.decision_function(X), theirs.decision_function(X), atol=1e-4)


def test_balanced_class_weight_counts_rows_as_the_installed_scikit_learn_does(monkeypatch):
    """class_weight="balanced" is n_samples / (n_classes * count per class); scikit-learn counts a class's rows by
    their sample weights from 1.7 and by rows before (scikit-learn#30057). hpdl does what the installed one does
    (`logistic.BALANCED_BY_WEIGHT`): both ways here, each against scikit-learn given the same weights by class."""
    X, y = _data("wine")
    w = np.random.default_rng(2).uniform(0.5, 2.0, len(y))
    for by_weight in (True, False):
        monkeypatch.setattr(logistic, "BALANCED_BY_WEIGHT", by_weight)
        ours = LogisticRegression(C=0.3, class_weight="balanced", **TIGHT).fit(X, y, sample_weight=w)
        counts = np.bincount(y, weights=w if by_weight else None)
        by_class = dict(enumerate(counts.sum() / (len(counts) * counts)))
        theirs = sklearn.linear_model.LogisticRegression(C=0.3, class_weight=by_class, **TIGHT)
        _close(ours, theirs.fit(X, y, sample_weight=w), X)


def test_logistic_bad_input_raises_sklearn_errors():
    X, y = _data("iris")
    with pytest.raises(ValueError, match="Unknown label type"):
        LogisticRegression().fit(X, X[:, 0])
    with pytest.raises(ValueError, match="at least 2 classes"):
        LogisticRegression().fit(X, np.zeros(len(X)))
    with pytest.raises(ValueError, match="L2 penalty only"):
        LogisticRegression(l1_ratio=0.5).fit(X, y)


def body_logistic(comm, nranks: int, empty_rank):
    sub = first_ranks(comm, nranks)
    if sub is None:
        return None
    out = {}
    for name, kwargs in CASES[:3]:
        X, y = _data(name)
        lo, hi = bounds(len(y), sub.size, empty_rank)[sub.rank]
        w = np.random.default_rng(2).uniform(0.5, 2.0, len(y))
        model = LogisticRegression(**kwargs, **TIGHT, comm=sub).fit(X[lo:hi], y[lo:hi], sample_weight=w[lo:hi])
        out[name] = (model.coef_, model.intercept_, model.score(X[lo:hi], y[lo:hi]), model.predict_proba(X[lo:hi]))
    return out


def _check_ranks(results, nranks: int) -> None:
    results = [r for r in results if r is not None]
    assert len(results) == nranks
    for name, kwargs in CASES[:3]:
        X, y = _data(name)
        w = np.random.default_rng(2).uniform(0.5, 2.0, len(y))
        one = LogisticRegression(**kwargs, **TIGHT).fit(X, y, sample_weight=w)
        theirs = sklearn.linear_model.LogisticRegression(**kwargs, **TIGHT).fit(X, y, sample_weight=w)
        proba = np.concatenate([r[name][3] for r in results])
        np.testing.assert_allclose(proba, one.predict_proba(X), atol=PROBA_ATOL)
        np.testing.assert_allclose(proba, theirs.predict_proba(X), atol=PROBA_ATOL)
        for r in results:
            np.testing.assert_array_equal(r[name][0], results[0][name][0])  # the same model on every rank
            scale = np.abs(one.coef_).max()
            np.testing.assert_allclose(r[name][0], one.coef_, atol=COEF_RTOL * scale, rtol=0)
            assert r[name][2] == pytest.approx(one.score(X, y), abs=1.5 / len(y))


def test_logistic_on_two_ranks_with_an_empty_shard(ranks):
    _check_ranks(ranks("mpi", 2).run(body_logistic, 2, 0, timeout=120), 2)


def test_logistic_on_three_uneven_ranks(ranks):
    _check_ranks(ranks("mpi", 4).run(body_logistic, 3, None, timeout=120), 3)


def body_bad_target(comm):
    X = np.ones((4, 2)) * np.arange(4)[:, None]
    y = np.array([0, 1, 0, 1]) if comm.rank == 0 else np.array([0.5, 1.5, 2.5, 3.5])
    LogisticRegression(comm=comm).fit(X, y)


def test_a_continuous_target_on_one_rank_raises_on_every_rank(ranks):
    results = ranks("mpi", 2).run(body_bad_target, expect_errors=True, timeout=60)
    assert "rank(s) [1]" in results[0].message and "Unknown label type" in results[1].message, results
