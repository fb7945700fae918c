"""K-Means with Hamerly bounds (hpdl.ml.bounds) runs Lloyd's iterations: same labels, centres and iteration count.

The bounds only decide which rows skip the distance product, and the sums
follow the labels incrementally, so the comparison is with the plain step
(`kernels.USE_BOUNDS = False`) on tie-free data: labels and iteration counts
identical, centres to 1e-12 relative and absolute (float64) and 1e-6 (float32: the kept sums may
round differently from sums recomputed in another order).
"""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits, make_blobs

from hpdl.ml import KMeans, bounds, kernels
from tie_free import jittered

pytestmark = pytest.mark.skipif(not kernels.USE_JIT, reason="the bounds run on the compiled loops (numba)")


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("name", ["digits", "blobs32"])
def test_bounds_run_lloyds_iterations(name, weighted, monkeypatch):
    if name == "digits":
        X = jittered(load_digits().data)
    else:
        X = make_blobs(4000, 8, centers=6, cluster_std=3.0, random_state=1)[0].astype(np.float32)
    w = np.random.default_rng(2).uniform(0.5, 2.0, len(X)) if weighted else None
    kwargs = dict(n_clusters=6, init=X[:6].copy(), n_init=1, tol=0.0, max_iter=100)
    ours = KMeans(**kwargs).fit(X, sample_weight=w)
    monkeypatch.setattr(kernels, "USE_BOUNDS", False)
    plain = KMeans(**kwargs).fit(X, sample_weight=w)
    assert ours.n_iter_ == plain.n_iter_ > 5
    np.testing.assert_array_equal(ours.labels_, plain.labels_)
    rtol = 1e-12 if X.dtype == np.float64 else 1e-6
    np.testing.assert_allclose(ours.cluster_centers_, plain.cluster_centers_, rtol=rtol, atol=rtol)
    assert ours.inertia_ == pytest.approx(plain.inertia_, rel=rtol)


def test_bounds_follow_relocated_empty_clusters(monkeypatch):
    """Two centres far from every point lose all of them at once and are re-seeded: the bounds must follow."""
    X = jittered(load_digits().data)[:600]
    far = np.vstack([X[:3], np.full((2, X.shape[1]), 500.0)])
    ours = KMeans(5, init=far, n_init=1, tol=0.0).fit(X)
    monkeypatch.setattr(kernels, "USE_BOUNDS", False)
    plain = KMeans(5, init=far, n_init=1, tol=0.0).fit(X)
    assert ours.n_iter_ == plain.n_iter_
    np.testing.assert_array_equal(ours.labels_, plain.labels_)
    np.testing.assert_allclose(ours.cluster_centers_, plain.cluster_centers_, rtol=1e-12, atol=1e-12)


def test_settled_rows_skip_the_product(monkeypatch):
    """Most rows of well-separated clusters are cleared by the bounds; once the centres stop, no row is recomputed."""
    X = make_blobs(20000, 8, centers=5, cluster_std=1.0, random_state=3)[0]
    X -= X.mean(axis=0)
    xsq = kernels.row_sq_norms(X)
    reassign = kernels._JIT["bounds_reassign"]
    recomputed = []

    def counting(*args):
        recomputed.append(len(args[2]))  # the rows this call assigns
        return reassign(*args)

    monkeypatch.setitem(kernels._JIT, "bounds_reassign", counting)
    state = bounds.State(len(X), 5, 8)
    centres, moves, per_iteration = X[:5].copy(), None, []
    for _ in range(30):
        recomputed.clear()
        sums, counts = bounds.partial(X, xsq, None, centres, moves, state)
        per_iteration.append(sum(recomputed))
        new = sums / counts[:, None]
        moves = bounds.moves_between(centres, new)
        centres = new
    assert per_iteration[0] == len(X)  # the first iteration assigns every row
    assert per_iteration[-1] == 0 and moves.max() == 0.0  # a fixed point: nothing moves, nothing is recomputed
    assert sum(per_iteration) < 0.3 * 30 * len(X)
    np.testing.assert_allclose(sums, [X[state.labels == j].sum(axis=0) for j in range(5)], rtol=1e-9, atol=1e-9)
    labels = ((X[:, None, :] - centres[None]) ** 2).sum(-1).argmin(1)
    np.testing.assert_array_equal(state.labels, labels)


def test_weighted_rows_that_leave_a_centre_leave_it_exactly_empty():
    """Weights 0.1 + 0.2 + 0.3 added and then subtracted leave 5.6e-17, not 0: without an exact count of its rows
    of non-zero weight the centre they left (keeping only a row of weight 0) would look non-empty and escape the
    empty-cluster relocation, as plain Lloyd's sums would not."""
    X = np.array([[0.0, 0.0], [0.1, 0.0], [10.0, 0.0], [10.1, 0.0], [5.0, 0.0], [5.1, 0.0], [5.2, 0.0], [5.5, 2.9]])
    w = np.array([1.0, 1.0, 1.0, 1.0, 0.1, 0.2, 0.3, 0.0])
    xsq = kernels.row_sq_norms(X)
    state = bounds.State(len(X), 3, 2)
    first = np.array([[0.0, 0.0], [10.0, 0.0], [5.1, 0.0]])
    bounds.partial(X, xsq, w, first, None, state)
    assert state.counts[2] == 0.1 + 0.2 + 0.3 != 0.6  # the rounded sum the subtraction cannot undo
    moved = np.array([[5.05, 0.0], [10.0, 0.0], [5.5, 3.0]])  # the weighted middle rows go to centre 0
    sums, counts = bounds.partial(X, xsq, w, moved, bounds.moves_between(first, moved), state)
    np.testing.assert_array_equal(state.labels, [0, 0, 1, 1, 0, 0, 0, 2])
    assert counts[2] == 0.0 and not sums[2].any() and state.members.tolist() == [5, 2, 0]
    np.testing.assert_allclose(sums[0], (w[[0, 1, 4, 5, 6], None] * X[[0, 1, 4, 5, 6]]).sum(0), rtol=1e-15)
