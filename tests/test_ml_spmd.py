"""hpdl.ml SPMD on real ranks: every rank's model equals one process's (and scikit-learn's) on the full data.

Shards are uneven, and one rank may hold no rows at all. Tolerances: the
ranks only reorder float64 sums, so centres and inertia agree with the
one-process fit to 1e-9 relative (the issue asks 1e-6), coefficients to
1e-8, neighbours exactly (distances to 1e-9).
"""

from __future__ import annotations

import numpy as np
import pytest
import sklearn.cluster
import sklearn.linear_model
import sklearn.neighbors
import torch
from sklearn.datasets import load_diabetes, load_digits, load_iris

from hpdl.ml import KMeans, KNeighborsClassifier, KNeighborsRegressor, LinearRegression, NearestNeighbors, Ridge, device
from ml_shards import bounds, first_ranks
from tie_free import jittered


def body_all(comm, nranks: int, empty_rank, kind: str = "numpy"):
    """Every estimator on this rank's shard. `kind="torch"`: the shards are torch tensors (the device path, on the
    CPU), and every array answer must come back a tensor (recorded as NumPy for the checks)."""
    sub = first_ranks(comm, nranks)
    if sub is None:
        return None
    T = (lambda a: torch.from_numpy(np.ascontiguousarray(a))) if kind == "torch" else (lambda a: a)  # noqa: E731
    device.CPU_TENSORS_ON_TORCH = kind == "torch"  # CPU tensors on the path GPU arrays take (reset below)
    try:
        return _every_estimator(sub, T, kind, empty_rank)
    finally:
        device.CPU_TENSORS_ON_TORCH = False


def _every_estimator(sub, T, kind: str, empty_rank) -> dict:
    out: dict = {"size": sub.size}
    # K-Means on iris (float64) with the same initial centres and with sample weights; k-means|| default
    X = jittered(load_iris().data)  # tie-free (tie_free.py): labels compared with scikit-learn's
    lo, hi = bounds(len(X), sub.size, empty_rank)[sub.rank]
    w = np.random.default_rng(0).uniform(0.5, 2.0, len(X))
    km = KMeans(3, init=X[[0, 50, 100]], n_init=1, comm=sub).fit(T(X[lo:hi]), sample_weight=T(w[lo:hi]))
    score = km.score(T(X[lo:hi]), sample_weight=T(w[lo:hi]))
    out["km"] = (km.cluster_centers_, km.inertia_, km.n_iter_, N(km.labels_, kind), score)
    auto = KMeans(3, random_state=0, comm=sub).fit(T(X[lo:hi]))
    out["km_auto"] = (auto.inertia_, auto.cluster_centers_)
    pp = KMeans(3, init="k-means++", random_state=0, comm=sub).fit(T(X[lo:hi]))
    out["km_pp"] = pp.inertia_
    out["km_none"] = KMeans(3, init="random", n_init=1, comm=sub).fit(T(X[lo:hi])).cluster_centers_  # random_state=None
    # an empty cluster on the way: two centres far away
    far = np.array([X[0], X[1], [50.0] * 4, [60.0] * 4])
    out["km_empty"] = KMeans(4, init=far, n_init=1, comm=sub).fit(T(X[lo:hi])).cluster_centers_
    # linear models on diabetes
    Xd, yd = load_diabetes(return_X_y=True)
    lo, hi = bounds(len(Xd), sub.size, empty_rank)[sub.rank]
    wd = np.random.default_rng(1).uniform(0.5, 2.0, len(yd))
    lin = LinearRegression(comm=sub).fit(T(Xd[lo:hi]), T(yd[lo:hi]), sample_weight=T(wd[lo:hi]))
    tsqr = Ridge(alpha=0.3, solver="tsqr", comm=sub).fit(T(Xd[lo:hi]), T(yd[lo:hi]))
    out["lin"] = (lin.coef_, lin.intercept_, lin.score(T(Xd[lo:hi]), T(yd[lo:hi])))
    out["ridge"] = (tsqr.coef_, tsqr.intercept_)
    # neighbours on digits: index 1500 rows, query 297 (each rank its own slice of each)
    Xg, yg = load_digits(return_X_y=True)
    lo, hi = bounds(1500, sub.size, empty_rank)[sub.rank]
    qlo, qhi = bounds(297, sub.size, None)[sub.rank]
    Q = T(Xg[1500 + qlo : 1500 + qhi])
    nn = NearestNeighbors(n_neighbors=4, comm=sub).fit(T(Xg[lo:hi]))
    out["nn"] = tuple(N(a, kind) for a in nn.kneighbors(Q))
    cos = NearestNeighbors(n_neighbors=4, metric="cosine", comm=sub).fit(T(Xg[lo:hi]))
    out["nn_cos"] = tuple(N(a, kind) for a in cos.kneighbors(Q))
    clf = KNeighborsClassifier(5, weights="distance", comm=sub).fit(T(Xg[lo:hi]), T(yg[lo:hi]))
    out["clf"] = (N(clf.predict(Q), kind), clf.score(Q, T(yg[1500 + qlo : 1500 + qhi])), clf.classes_)
    reg = KNeighborsRegressor(3, comm=sub).fit(T(Xg[lo:hi]), T(yg[lo:hi].astype(float)))
    out["reg"] = N(reg.predict(Q), kind)
    return out


def N(answer, kind: str) -> np.ndarray:  # noqa: N802 - the counterpart of T
    """An answer as NumPy, after checking that it came back in the input's kind (tensors in, tensors out)."""
    if kind == "torch":
        assert isinstance(answer, torch.Tensor), type(answer)
        return answer.numpy()
    assert isinstance(answer, np.ndarray), type(answer)
    return answer


def _reference():
    X = jittered(load_iris().data)  # tie-free (tie_free.py): labels compared with scikit-learn's
    w = np.random.default_rng(0).uniform(0.5, 2.0, len(X))
    ref: dict = {}
    sk = sklearn.cluster.KMeans(3, init=X[[0, 50, 100]], n_init=1).fit(X, sample_weight=w)
    ref["km"] = sk
    far = np.array([X[0], X[1], [50.0] * 4, [60.0] * 4])
    ref["km_empty"] = sklearn.cluster.KMeans(4, init=far, n_init=1).fit(X).cluster_centers_
    ref["km_best"] = sklearn.cluster.KMeans(3, n_init=10, random_state=0).fit(X).inertia_
    Xd, yd = load_diabetes(return_X_y=True)
    wd = np.random.default_rng(1).uniform(0.5, 2.0, len(yd))
    ref["lin"] = sklearn.linear_model.LinearRegression().fit(Xd, yd, sample_weight=wd)
    ref["lin_score"] = ref["lin"].score(Xd, yd)
    ref["ridge"] = sklearn.linear_model.Ridge(alpha=0.3).fit(Xd, yd)
    Xg, yg = load_digits(return_X_y=True)
    # one neighbour more than asked: a tie between the 4th and the 5th makes the 4th index arbitrary
    ref["nn"] = (
        sklearn.neighbors.NearestNeighbors(n_neighbors=5, algorithm="brute").fit(Xg[:1500]).kneighbors(Xg[1500:])
    )
    ref["nn_cos"] = (
        sklearn.neighbors.NearestNeighbors(n_neighbors=5, metric="cosine", algorithm="brute")
        .fit(Xg[:1500])
        .kneighbors(Xg[1500:])
    )
    clf = sklearn.neighbors.KNeighborsClassifier(5, weights="distance").fit(Xg[:1500], yg[:1500])
    ref["clf"] = (clf.predict(Xg[1500:]), clf.score(Xg[1500:], yg[1500:]))
    ref["reg"] = sklearn.neighbors.KNeighborsRegressor(3).fit(Xg[:1500], yg[:1500].astype(float)).predict(Xg[1500:])
    return ref


REF: dict = {}


def _check(results: list, nranks: int) -> None:
    if not REF:
        REF.update(_reference())
    results = [r for r in results if r is not None]
    assert len(results) == nranks and all(r["size"] == nranks for r in results)
    sk = REF["km"]
    labels = np.concatenate([r["km"][3] for r in results])
    for r in results:  # every rank holds the same model
        centres, inertia, n_iter, _, score = r["km"]
        np.testing.assert_allclose(centres, sk.cluster_centers_, rtol=1e-9, atol=1e-12)
        assert inertia == pytest.approx(sk.inertia_, rel=1e-9) and n_iter == sk.n_iter_
        assert score == pytest.approx(-sk.inertia_, rel=1e-9)
        np.testing.assert_allclose(np.sort(r["km_empty"], 0), np.sort(REF["km_empty"], 0), rtol=1e-9)
        np.testing.assert_allclose(r["km_auto"][1], results[0]["km_auto"][1])
        np.testing.assert_array_equal(r["km_none"], results[0]["km_none"])  # one random stream for all ranks
        # k-means|| and distributed k-means++ reach a local optimum close to sklearn's best of 10
        assert r["km_auto"][0] <= 1.05 * REF["km_best"] and r["km_pp"] <= 1.05 * REF["km_best"]
        coef, intercept, score = r["lin"]
        np.testing.assert_allclose(coef, REF["lin"].coef_, rtol=1e-8)
        assert intercept == pytest.approx(REF["lin"].intercept_, rel=1e-8)
        assert score == pytest.approx(REF["lin_score"], rel=1e-8)
        np.testing.assert_allclose(r["ridge"][0], REF["ridge"].coef_, rtol=1e-8)
        assert r["ridge"][1] == pytest.approx(REF["ridge"].intercept_, rel=1e-8)
        assert r["clf"][1] == pytest.approx(REF["clf"][1], abs=0.01)  # a tie may move one vote
        np.testing.assert_array_equal(r["clf"][2], np.arange(10))
    np.testing.assert_array_equal(labels, sk.labels_)
    for key in ("nn", "nn_cos"):
        dist = np.concatenate([r[key][0] for r in results])
        idx = np.concatenate([r[key][1] for r in results])
        ref_dist, ref_idx = REF[key]
        np.testing.assert_allclose(dist, ref_dist[:, :4], rtol=1e-9, atol=1e-9)
        unique = np.all(np.diff(ref_dist, axis=1) > 1e-9, axis=1)  # rows without tied distances
        assert unique.sum() > 100
        np.testing.assert_array_equal(idx[unique], ref_idx[unique, :4])
    clear = REF["nn"][0][:, 3] - REF["nn"][0][:, 2] > 1e-9  # the 3 nearest are not tied with the 4th
    five = REF["nn"][0][:, 4] - REF["nn"][0][:, 3] > 1e-9  # nor the 4 nearest with the 5th (k=5 votes)
    votes = np.concatenate([r["clf"][0] for r in results])
    np.testing.assert_array_equal(votes[clear & five], REF["clf"][0][clear & five])
    np.testing.assert_allclose(np.concatenate([r["reg"] for r in results])[clear], REF["reg"][clear], rtol=1e-12)


def test_two_ranks_with_an_empty_shard_match_sklearn(ranks):
    _check(ranks("mpi", 2).run(body_all, 2, 0, timeout=120), 2)


def test_two_ranks_on_torch_tensors_match_sklearn(ranks):
    """The same estimators on torch tensor shards (what CuPy input becomes): the same answers, as tensors."""
    _check(ranks("mpi", 2).run(body_all, 2, 0, "torch", timeout=120), 2)


def test_three_ranks_uneven_match_sklearn(ranks):
    _check(ranks("mpi", 4).run(body_all, 3, None, timeout=120), 3)


def body_mismatch(comm, case: str):
    X = np.ones((5, 3), dtype=np.float64)
    if case == "features" and comm.rank == 1:
        X = np.ones((5, 4))
    if case == "dtype" and comm.rank == 1:
        X = X.astype(np.float32)
    if case == "nan" and comm.rank == 1:
        X[2, 1] = np.nan
    if case == "all_empty":
        X = X[:0]
    if case == "query_nan":
        nn = NearestNeighbors(n_neighbors=2, comm=comm).fit(X)
        nn.kneighbors(X if comm.rank == 0 else np.full((2, 3), np.nan))
    KMeans(2, comm=comm).fit(X)


@pytest.mark.parametrize(
    "case, pattern",
    [
        ("features", r"feature counts \(ranks \[0\]: 3, ranks \[1\]: 4\)"),
        ("dtype", r"dtypes \(ranks \[0\]: float64, ranks \[1\]: float32\)"),
        ("nan", r"rank\(s\) \[1\].*NaN"),
        ("all_empty", r"empty shard"),
        ("query_nan", r"rank\(s\) \[1\].*NaN"),
    ],
)
def test_shards_that_disagree_raise_on_every_rank(ranks, case, pattern):
    import re

    results = ranks("mpi", 2).run(body_mismatch, case, expect_errors=True, timeout=60)
    assert all(r is not None and "Error" in r.type_name for r in results), results
    other = results[0] if case in ("nan", "query_nan") else results[1]
    assert re.search(pattern, other.message) or re.search(pattern, results[0].message), [str(r) for r in results]
    if case in ("nan", "query_nan"):
        assert "NaN" in results[1].message  # the failing rank raises scikit-learn's own error
