"""hpdl.ml on a Dask array (LocalCluster, 2 in-process workers) equals the one-process fit on the same data.

Tolerances as in test_ml_local: the blocks only reorder float64 sums (1e-9
relative for centres/inertia, 1e-8 for coefficients; neighbours exact).
"""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_diabetes, load_digits, load_iris

from hpdl.ml import KMeans, KNeighborsClassifier, KNeighborsRegressor, LinearRegression, NearestNeighbors, Ridge

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None)
    with distributed.Client(cluster) as c:
        yield c
    cluster.close()


def test_kmeans_on_dask_equals_one_process(client):
    X = load_iris().data
    w = np.random.default_rng(0).uniform(0.5, 2.0, len(X))
    dX, dw = da.from_array(X, chunks=(40, 4)), da.from_array(w, chunks=40)  # 4 uneven blocks
    init = X[[0, 50, 100]]
    ours = KMeans(3, init=init, n_init=1).fit(dX, sample_weight=dw)
    ref = KMeans(3, init=init, n_init=1).fit(X, sample_weight=w)
    np.testing.assert_allclose(ours.cluster_centers_, ref.cluster_centers_, rtol=1e-9)
    assert ours.inertia_ == pytest.approx(ref.inertia_, rel=1e-9) and ours.n_iter_ == ref.n_iter_
    assert isinstance(ours.labels_, da.Array)
    np.testing.assert_array_equal(ours.labels_.compute(), ref.labels_)
    np.testing.assert_array_equal(ours.predict(dX).compute(), ref.predict(X))
    np.testing.assert_allclose(ours.transform(dX).compute(), ref.transform(X), rtol=1e-9)
    assert ours.score(dX) == pytest.approx(ref.score(X), rel=1e-9)
    far = np.array([X[0], X[1], [50.0] * 4, [60.0] * 4])  # empty clusters relocated across blocks
    np.testing.assert_allclose(
        KMeans(4, init=far, n_init=1).fit(dX).cluster_centers_, KMeans(4, init=far, n_init=1).fit(X).cluster_centers_
    )
    auto = KMeans(3, random_state=0).fit(dX)  # k-means|| by default on distributed data
    assert auto.inertia_ <= 1.05 * KMeans(3, n_init=10, random_state=0).fit(X).inertia_
    bad = X.copy()
    bad[7, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        KMeans(3).fit(da.from_array(bad, chunks=50))


def test_fitted_kmeans_keeps_only_its_labels_on_the_workers(client):
    """fit persists a centred copy of X (and its row norms) on the workers; the fitted model must not pin it."""
    import gc
    import time

    from hpdl.ml.dask_backend import DaskShards
    from hpdl.ml.kmeans import _prepare

    X = load_iris().data
    dX = da.from_array(X, chunks=(40, 4))
    init = X[[0, 50, 100]]

    def centred_keys():
        return [key for keys in client.has_what().values() for key in keys if str(key).startswith("_prepare-")]

    def released(deadline: float) -> bool:
        gc.collect()
        while centred_keys() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not centred_keys()

    model = KMeans(3, init=init, n_init=1).fit(dX)
    assert released(time.monotonic() + 10), centred_keys()
    np.testing.assert_array_equal(model.labels_.compute(), KMeans(3, init=init, n_init=1).fit(X).labels_)
    # the control: while a centred copy is held, the keys above are what the workers hold
    held = DaskShards.build(dX, [None], dtype=np.float64, estimator="test").transform(_prepare, X.mean(axis=0))
    distributed.wait(held.parts)
    assert len(centred_keys()) == len(dX.chunks[0])
    del held
    assert released(time.monotonic() + 10)


def test_linear_models_on_dask_equal_one_process(client):
    X, y = load_diabetes(return_X_y=True)
    dX, dy = da.from_array(X, chunks=(100, 10)), da.from_array(y, chunks=100)
    for ours, ref in (
        (LinearRegression(), LinearRegression()),
        (Ridge(alpha=0.5, solver="tsqr"), Ridge(alpha=0.5)),
    ):
        ours.fit(dX, dy)
        ref.fit(X, y)
        np.testing.assert_allclose(ours.coef_, ref.coef_, rtol=1e-8)
        assert ours.intercept_ == pytest.approx(ref.intercept_, rel=1e-8)
        np.testing.assert_allclose(ours.predict(dX).compute(), ref.predict(X), rtol=1e-9)
        assert ours.score(dX, dy) == pytest.approx(ref.score(X, y), rel=1e-9)


def test_neighbours_on_dask_equal_one_process(client):
    X, y = load_digits(return_X_y=True)
    dX, dy = da.from_array(X[:1500], chunks=(400, 64)), da.from_array(y[:1500], chunks=400)
    queries = X[1500:]
    od, oi = NearestNeighbors(n_neighbors=4).fit(dX).kneighbors(queries)
    rd, ri = NearestNeighbors(n_neighbors=5).fit(X[:1500]).kneighbors(queries)
    np.testing.assert_allclose(od, rd[:, :4], rtol=1e-9)
    clear = np.all(np.diff(rd, axis=1) > 1e-9, axis=1)  # tied distances may take either index
    np.testing.assert_array_equal(oi[clear], ri[clear, :4])
    clf = KNeighborsClassifier(5, weights="distance").fit(dX, dy)
    np.testing.assert_array_equal(clf.classes_, np.arange(10))
    ref = KNeighborsClassifier(5, weights="distance").fit(X[:1500], y[:1500])
    np.testing.assert_array_equal(clf.predict(queries)[clear], ref.predict(queries)[clear])
    reg = KNeighborsRegressor(3).fit(dX, dy.astype(float))
    ref_reg = KNeighborsRegressor(3).fit(X[:1500], y[:1500])
    np.testing.assert_allclose(reg.predict(queries)[clear], ref_reg.predict(queries)[clear])


def test_logistic_pca_and_svd_on_dask_equal_one_process(client):
    from sklearn.datasets import load_breast_cancer, load_wine
    from sklearn.preprocessing import StandardScaler

    from hpdl.ml import PCA, LogisticRegression, TruncatedSVD

    for load in (load_wine, load_breast_cancer):  # multinomial, then binary
        X, y = load(return_X_y=True)
        X = StandardScaler().fit_transform(X)
        dX, dy = da.from_array(X, chunks=(50, X.shape[1])), da.from_array(y, chunks=50)
        ours = LogisticRegression(C=0.5, tol=1e-10, max_iter=5000).fit(dX, dy)
        ref = LogisticRegression(C=0.5, tol=1e-10, max_iter=5000).fit(X, y)
        np.testing.assert_allclose(ours.coef_, ref.coef_, atol=1e-4 * np.abs(ref.coef_).max())
        np.testing.assert_allclose(ours.predict_proba(dX).compute(), ref.predict_proba(X), atol=1e-5)
        np.testing.assert_array_equal(ours.classes_, ref.classes_)
        assert ours.score(dX, dy) == pytest.approx(ref.score(X, y), abs=1.5 / len(y))
    X = StandardScaler().fit_transform(load_wine().data) + 0.5
    dX = da.from_array(X, chunks=(40, 13))
    for solver in ("covariance_eigh", "tsqr"):
        ours, ref = PCA(4, svd_solver=solver).fit(dX), PCA(4).fit(X)
        np.testing.assert_allclose(ours.explained_variance_, ref.explained_variance_, rtol=1e-9)
        np.testing.assert_allclose(np.abs(ours.components_), np.abs(ref.components_), atol=1e-9)
        signs = np.sign(np.sum(ours.components_ * ref.components_, axis=1))
        np.testing.assert_allclose(ours.transform(dX).compute() * signs, ref.transform(X), atol=1e-9)
    ours, ref = TruncatedSVD(3).fit(dX), TruncatedSVD(3).fit(X)
    np.testing.assert_allclose(ours.singular_values_, ref.singular_values_, rtol=1e-9)
    np.testing.assert_allclose(ours.explained_variance_ratio_, ref.explained_variance_ratio_, rtol=1e-9)
