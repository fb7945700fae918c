"""The two kernel paths agree: the compiled NumPy path and the torch path (which CUDA arrays take via DLPack).

No GPU here: the torch path runs on CPU tensors, so a CuPy or CUDA-tensor
block would run the same code on the device. Float64 data without
near-ties: labels and neighbour indices identical, sums to 1e-12.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpdl.ml import bounds, kernels


@pytest.fixture
def data():
    rng = np.random.default_rng(3)
    centres = rng.normal(size=(6, 5)) * 4
    X = centres[rng.integers(0, 6, 3000)] + rng.normal(size=(3000, 5))
    return X, centres + 0.3, rng.uniform(0.5, 2.0, len(X))


@pytest.mark.parametrize("weighted", [False, True])
def test_lloyd_and_assign_paths_agree(data, weighted, monkeypatch):
    X, C, w = data
    w = w if weighted else None
    xsq = kernels.row_sq_norms(X)
    fused = kernels.lloyd_partial(X, xsq, w, C)
    labels, dist = kernels.assign(X, xsq, C)
    monkeypatch.setattr(kernels, "USE_JIT", False)
    plain = kernels.lloyd_partial(X, xsq, w, C)
    on_tensors = kernels.lloyd_partial(
        torch.from_numpy(X), torch.from_numpy(xsq), None if w is None else torch.from_numpy(w), C
    )
    for got in (plain, on_tensors):
        np.testing.assert_allclose(np.asarray(got[0]), fused[0], rtol=1e-12)
        np.testing.assert_array_equal(np.asarray(got[1]), fused[1])
        assert got[2] == pytest.approx(fused[2], rel=1e-12)
    ref = ((X[:, None, :] - C[None]) ** 2).sum(-1)
    np.testing.assert_array_equal(labels, ref.argmin(1))
    np.testing.assert_allclose(dist, ref.min(1), rtol=1e-9)
    t_labels, t_dist = kernels.assign(torch.from_numpy(X), None, C)
    np.testing.assert_array_equal(t_labels.numpy(), labels)
    np.testing.assert_allclose(t_dist.numpy(), dist, rtol=1e-9)


@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
def test_knn_paths_agree_and_are_exact(data, metric, monkeypatch):
    X, _, _ = data
    index, queries = X[:2500], X[2500:]
    isq = kernels.row_sq_norms(index)
    monkeypatch.setattr(kernels, "KNN_QUERY_ROWS", 64)  # several query blocks and index chunks
    monkeypatch.setattr(kernels, "KNN_INDEX_ROWS", 300)
    dist, idx = kernels.knn_block(index, isq, queries, 7, 10, metric)
    if metric == "euclidean":
        ref = ((queries[:, None, :] - index[None]) ** 2).sum(-1)
    else:
        unit = index / np.linalg.norm(index, axis=1, keepdims=True)
        ref = 1 - (queries / np.linalg.norm(queries, axis=1, keepdims=True)) @ unit.T
    order = np.argsort(ref, axis=1)[:, :7]
    np.testing.assert_array_equal(idx - 10, order)
    np.testing.assert_allclose(dist, np.take_along_axis(ref, order, 1), rtol=1e-9, atol=1e-12)
    monkeypatch.setattr(kernels, "USE_JIT", False)
    t_dist, t_idx = kernels.knn_block(
        torch.from_numpy(index), torch.from_numpy(isq), torch.from_numpy(queries), 7, 10, metric
    )
    np.testing.assert_array_equal(t_idx, idx)
    np.testing.assert_allclose(t_dist, dist, rtol=1e-9, atol=1e-9)


@pytest.mark.skipif(not kernels.USE_JIT, reason="numba is not installed: the torch path needs no compilation")
def test_a_new_process_loads_the_compiled_loops_from_numba_cache():
    """A compiled function in a closure cell made numba's cache key differ per process: every process
    compiled the loops again (3-4 s each) and added a cache entry no other process could use."""
    import json
    import subprocess
    import sys

    kernels.warm_up()  # this process: compiles, or loads what an earlier one wrote
    bounds.warm_up()
    probe = (
        "import json; from hpdl.ml import bounds, kernels, fused_loops as f; kernels.warm_up(); bounds.warm_up(); "
        "fns = (f.lloyd_step, f.assign_step, f.topk_insert, f.bounds_check, f.bounds_tighten, f.bounds_reassign); "
        "print(json.dumps([sum(g.stats.cache_hits.values()) for g in fns] + "
        "[sum(g.stats.cache_misses.values()) for g in fns]))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    hits, misses = counts[:6], counts[6:]
    assert misses == [0] * 6 and all(h >= 1 for h in hits), counts  # every specialisation, from disk
