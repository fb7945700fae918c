"""Device arrays in, device arrays out: hpdl.ml's K-Means and neighbours on torch tensors, in one process.

A CuPy array reaches the same code as a torch tensor on its GPU (through
DLPack, no copy), so torch CPU tensors exercise the device path here, where
there is no GPU (`device.CPU_TENSORS_ON_TORCH`; by default a CPU tensor is
computed through NumPy, last test): the torch kernels instead of the compiled NumPy loops, the
checks on the tensor, answers as tensors. They must equal the NumPy path's
(float64: centres to 1e-9, labels and neighbours exactly, on tie-free data).
`tests/test_ml_spmd.py` runs the same on two ranks.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits, load_iris, make_blobs

from hpdl.ml import KMeans, KNeighborsClassifier, KNeighborsRegressor, LinearRegression, NearestNeighbors, device
from tie_free import jittered


@pytest.fixture(autouse=True)
def device_path_on_cpu_tensors(monkeypatch):
    """CPU tensors take NumPy's path by default; here they must take the one a GPU array takes."""
    monkeypatch.setattr(device, "CPU_TENSORS_ON_TORCH", True)


def test_kmeans_on_a_tensor_equals_numpy_and_answers_in_tensors():
    X = jittered(load_iris().data)
    w = np.random.default_rng(0).uniform(0.5, 2.0, len(X))
    Xt, wt = torch.from_numpy(X.copy()), torch.from_numpy(w)
    start = X[[0, 50, 100]]
    ours = KMeans(3, init=start, n_init=1).fit(Xt, sample_weight=wt)
    plain = KMeans(3, init=start, n_init=1).fit(X, sample_weight=w)
    assert isinstance(ours.labels_, torch.Tensor) and ours.labels_.dtype == torch.int32
    assert isinstance(ours.cluster_centers_, np.ndarray)  # fitted parameters are small: NumPy, as cuML's
    np.testing.assert_array_equal(ours.labels_.numpy(), plain.labels_)
    np.testing.assert_allclose(ours.cluster_centers_, plain.cluster_centers_, rtol=1e-9, atol=1e-12)
    assert ours.inertia_ == pytest.approx(plain.inertia_, rel=1e-9) and ours.n_iter_ == plain.n_iter_
    predicted, distances = ours.predict(Xt[:40]), ours.transform(Xt[:40])
    assert isinstance(predicted, torch.Tensor) and isinstance(distances, torch.Tensor)
    np.testing.assert_array_equal(predicted.numpy(), plain.predict(X[:40]))
    np.testing.assert_allclose(distances.numpy(), plain.transform(X[:40]), rtol=1e-9)
    assert ours.score(Xt) == pytest.approx(plain.score(X), rel=1e-9)


@pytest.mark.parametrize("init", ["k-means++", "random", "k-means||"])
def test_kmeans_initialisations_run_on_the_tensor(init):
    """k-means++ on a device block is the greedy distributed variant (its own draws): a good local optimum."""
    X, _ = make_blobs(2000, 6, centers=5, cluster_std=1.0, random_state=4)
    Xt = torch.from_numpy(X.astype(np.float32))
    ours = KMeans(5, init=init, random_state=0, n_init=10).fit(Xt)
    best = KMeans(5, random_state=0, n_init=10).fit(X.astype(np.float32))
    assert ours.cluster_centers_.dtype == np.float32 and ours.labels_.dtype == torch.int32
    assert ours.inertia_ <= 1.05 * best.inertia_


def test_neighbours_on_tensors_equal_numpy():
    X, y = load_digits(return_X_y=True)
    X = jittered(X)
    index, queries = X[:1500], X[1500:]
    Xt, Qt, yt = torch.from_numpy(index.copy()), torch.from_numpy(queries.copy()), torch.from_numpy(y[:1500])
    for metric in ("euclidean", "cosine"):
        dist, idx = NearestNeighbors(n_neighbors=4, metric=metric).fit(Xt).kneighbors(Qt)
        ref_dist, ref_idx = NearestNeighbors(n_neighbors=4, metric=metric).fit(index).kneighbors(queries)
        assert isinstance(dist, torch.Tensor) and isinstance(idx, torch.Tensor)
        np.testing.assert_array_equal(idx.numpy(), ref_idx)
        np.testing.assert_allclose(dist.numpy(), ref_dist, rtol=1e-12, atol=1e-12)
    own = NearestNeighbors(n_neighbors=3).fit(Xt).kneighbors()  # X=None: the fitted rows, each without itself
    assert isinstance(own[1], torch.Tensor)
    np.testing.assert_array_equal(own[1].numpy(), NearestNeighbors(n_neighbors=3).fit(index).kneighbors()[1])
    clf = KNeighborsClassifier(5, weights="distance").fit(Xt, yt)
    plain_clf = KNeighborsClassifier(5, weights="distance").fit(index, y[:1500])
    assert isinstance(clf.predict(Qt), torch.Tensor) and isinstance(clf.predict_proba(Qt), torch.Tensor)
    np.testing.assert_array_equal(clf.predict(Qt).numpy(), plain_clf.predict(queries))
    assert clf.score(Qt, torch.from_numpy(y[1500:])) == plain_clf.score(queries, y[1500:])
    reg = KNeighborsRegressor(3).fit(Xt, yt.double())
    plain_reg = KNeighborsRegressor(3).fit(index, y[:1500].astype(float))
    np.testing.assert_allclose(reg.predict(Qt).numpy(), plain_reg.predict(queries), rtol=1e-12)
    assert reg.score(Qt, y[1500:].astype(float)) == pytest.approx(plain_reg.score(queries, y[1500:]), rel=1e-12)


def test_bad_tensors_are_refused_in_scikit_learns_words():
    X = torch.from_numpy(jittered(load_iris().data))
    with pytest.raises(ValueError, match="Input X contains NaN"):
        KMeans(2).fit(torch.where(X > 7.5, torch.nan, X))
    with pytest.raises(ValueError, match="Expected 2D array, got 1D array"):
        KMeans(2).fit(X[:, 0])
    with pytest.raises(ValueError, match="Found array with dim 3, while dim <= 2 is required by KMeans"):
        KMeans(2).fit(X[None])
    with pytest.raises(ValueError, match=r"Found array with 0 sample\(s\)"):
        NearestNeighbors().fit(X[:0])
    with pytest.raises(ValueError, match="Complex data not supported"):
        KMeans(2).fit(X.to(torch.complex128))
    fitted = KMeans(2, n_init=1).fit(X)
    with pytest.raises(ValueError, match="X has 3 features, but KMeans is expecting 4"):
        fitted.predict(X[:, :3])
    as_int = KMeans(2, init=X[:2].numpy(), n_init=1).fit(X.round().to(torch.int64))
    assert as_int.cluster_centers_.dtype == np.float64  # integers become float64, as check_array does
    as_bf16 = KMeans(2, init=X[:2].numpy(), n_init=1).fit(X.to(torch.bfloat16))  # a dtype NumPy has not
    assert as_bf16.cluster_centers_.dtype == np.float64


def test_estimators_without_a_device_path_take_a_host_copy():
    X, y = make_blobs(300, 4, random_state=1)
    coef = LinearRegression().fit(torch.from_numpy(X), torch.from_numpy(y.astype(float))).coef_
    assert isinstance(coef, np.ndarray)
    np.testing.assert_allclose(coef, LinearRegression().fit(X, y.astype(float)).coef_, rtol=1e-12)


def test_cpu_tensors_take_numpys_path_and_get_tensors_back(monkeypatch):
    """By default a CPU tensor is a NumPy view: the compiled loops and scikit-learn's own k-means++ draws."""
    monkeypatch.setattr(device, "CPU_TENSORS_ON_TORCH", False)
    X = jittered(load_iris().data)
    Xt = torch.from_numpy(X.copy())
    ours, plain = KMeans(3, random_state=5).fit(Xt), KMeans(3, random_state=5).fit(X)
    assert isinstance(ours.labels_, torch.Tensor) and isinstance(ours.predict(Xt), torch.Tensor)
    np.testing.assert_array_equal(ours.labels_.numpy(), plain.labels_)
    np.testing.assert_array_equal(ours.cluster_centers_, plain.cluster_centers_)  # the same draws, the same loops
    grad = Xt.clone().requires_grad_(True)
    fitted = NearestNeighbors(n_neighbors=3).fit(grad)
    dist, idx = fitted.kneighbors(grad[:20])
    assert isinstance(dist, torch.Tensor) and not dist.requires_grad
    assert isinstance(copy.deepcopy(fitted).kneighbors()[1], torch.Tensor)  # X=None: the fitted input's kind
    assert KMeans(2, n_init=1).fit(Xt.bfloat16()).cluster_centers_.dtype == np.float64  # NumPy has no bfloat16
    np.testing.assert_array_equal(idx.numpy(), NearestNeighbors(n_neighbors=3).fit(X).kneighbors(X[:20])[1])
