"""The math every mode shares: one block of rows in, small partial results out.

Distances go through matrix products, ``||x - c||^2 = ||x||^2 - 2 x.c + ||c||^2``,
over row chunks sized to stay in cache (the chunk's distance matrix and rows
together about 1 MiB), so memory stays bounded whatever the block size. The
inner loops run in torch on the array's own memory (no copy; float32 stays
float32): measured single-threaded on 200,000 x 32 x 16 centres, torch's
addmm + min + index_add took ~95 ms per million rows against ~150 ms for the
same NumPy code, whose row-wise argmin and one-hot sums are slower. Partial
sums are accumulated in float64 across chunks.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import numpy as np
import torch

from hpdl.ml import device
from hpdl.ml.base import numpy_dtype

__all__ = [
    "warm_up",
    "chunk_rows",
    "row_sq_norms",
    "lloyd_partial",
    "assign",
    "exact_inertia",
    "min_sq_dist",
    "farthest",
    "gram_partial",
    "knn_block",
    "merge_topk",
]

CHUNK_BYTES = 1 << 20


def _compile() -> dict[str, Any]:
    """The fused loops (numba), or {} where numba is not installed (the torch path then runs)."""
    try:
        from hpdl.ml import fused_loops
    except ImportError:
        return {}
    return {
        "lloyd": fused_loops.lloyd_step,
        "assign": fused_loops.assign_step,
        "topk": fused_loops.topk_insert,
        "bounds_check": fused_loops.bounds_check,
        "bounds_tighten": fused_loops.bounds_tighten,
        "bounds_reassign": fused_loops.bounds_reassign,
    }


_JIT = _compile()
_NO_WEIGHTS = np.zeros(1)
USE_JIT = bool(_JIT)
"""False forces the torch path (the one CUDA tensors take); tests flip it to compare the two."""
USE_BOUNDS = True
"""False makes K-Means compute every distance every iteration (`hpdl.ml.bounds` skips those its bounds settle)."""


def warm_up() -> None:
    """Compile (or load from numba's cache) the fused loops for float32/float64, with and without weights.

    A benchmark calls it before timing, so that JIT compilation is set-up time (`hpdl.ml.jit_cache` also compiles
    the Hamerly-bound loops, for `make install`).
    """
    for dtype in (np.float32, np.float64):
        X = np.ones((2, 2), dtype=dtype)
        for w in (None, np.ones(2)):
            lloyd_partial(X, row_sq_norms(X), w, X[:1].copy())
        assign(X, None, X[:1].copy())
        knn_block(X, row_sq_norms(X), X, 1, 0, "euclidean")


def chunk_rows(n_features: int, n_centres: int, itemsize: int, most: int = 16384) -> int:
    """Rows per chunk so that the chunk and its distance matrix fit ~1 MiB (between 256 and `most`)."""
    rows = CHUNK_BYTES // max(1, itemsize * (n_features + n_centres))
    return int(min(most, max(256, rows)))


DEVICE_CHUNK_BYTES = 256 << 20
"""A chunk's bytes on a GPU: one chunk of 1M x 32 rows and 16 centres, where CPU-sized chunks launched ~1,500
small kernels per Lloyd iteration (46 ms on an H200, slower than NumPy on 16 cores; measured by `hpdl bench gpu`)."""


def tensor_chunk_rows(t: torch.Tensor, n_features: int, n_centres: int) -> int:
    """`chunk_rows` for a tensor: cache-sized on the CPU, `DEVICE_CHUNK_BYTES` on a GPU (few large kernels)."""
    if t.device.type == "cpu":
        return chunk_rows(n_features, n_centres, t.element_size())
    return max(256, DEVICE_CHUNK_BYTES // max(1, t.element_size() * (n_features + n_centres)))


LLOYD_MAX_ROWS = 4096
"""Rows per Lloyd chunk at most: measured best on 500k x 32 x 16 float32 (the chunk and its k x rows distance
block stay in L2 between the product and the pass that reads them back)."""


class _Workspace(threading.local):
    """Per-thread scratch buffers reused across calls and iterations (a Dask worker may run two blocks at once)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, Any] = {}

    def get(self, key: tuple, make: Callable[[], Any]) -> Any:
        buf = self.buffers.get(key)
        if buf is None:
            if len(self.buffers) > 16:
                self.buffers.clear()
            buf = self.buffers[key] = make()
        return buf


_WORK = _Workspace()


def _lloyd_buffers(k: int, step: int, dtype: Any) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """(k x step distance block, best distance per row, label per row), allocated once per shape and thread."""
    dt = np.dtype(dtype)
    return _WORK.get(
        ("lloyd", k, step, dt.str),
        lambda: (
            torch.empty(k * step, dtype=torch.from_numpy(np.zeros(0, dt)).dtype),
            np.empty(step, dt),
            np.empty(step, np.int32),
        ),
    )


def _use_jit(*arrays: Any) -> bool:
    return USE_JIT and all(a is None or isinstance(a, np.ndarray) for a in arrays)


def _t(a: Any) -> torch.Tensor:
    """A torch view of a NumPy array (or a CUDA array through DLPack), without copying."""
    if isinstance(a, torch.Tensor):
        return a
    if isinstance(a, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(a))
    return torch.from_dlpack(a)  # CuPy and other DLPack producers


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def row_sq_norms(X: Any) -> Any:
    """||x||^2 per row. NumPy's einsum reads the rows once (3 ms for 500k x 32 float32); torch's x * x then sum
    wrote a temporary as large as X first (35 ms, most of it page faults on the fresh memory)."""
    if isinstance(X, np.ndarray):
        return np.einsum("ij,ij->i", X, X)
    Xt = _t(X)  # a device block's norms stay on its device
    return (Xt * Xt).sum(1)


def _centre_terms(centres: np.ndarray, dtype: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(-2 C^T contiguous, ||c||^2): the two operands of the fused addmm (rows x k layout, the torch path)."""
    C = torch.from_numpy(np.ascontiguousarray(centres, dtype=dtype))
    return (-2.0 * C).T.contiguous(), (C * C).sum(1)


def _centre_terms_t(centres: np.ndarray, dtype: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(-2 C, ||c||^2 as a column): operands of the k x rows product whose columns the fused argmin scans."""
    C = torch.from_numpy(np.ascontiguousarray(centres, dtype=dtype))
    return -2.0 * C, (C * C).sum(1)[:, None].contiguous()


def lloyd_partial(
    X: np.ndarray, xsq: np.ndarray, w: Optional[np.ndarray], centres: np.ndarray
) -> tuple[np.ndarray, np.ndarray, float]:
    """One Lloyd E-step on a block: per-centre weighted sums and weights, and the block's inertia.

    Inertia here is measured against `centres` (the centres before this
    update), as in scikit-learn's Lloyd loop. NumPy blocks take the fused
    path: per chunk one product `||c||^2 - 2 C X^T` (k x rows, into a reused
    buffer) and one compiled pass for argmin, sums, weights and inertia.
    Other arrays (torch, CUDA through DLPack) take the torch path.
    """
    k, d = centres.shape
    n = X.shape[0]
    if n == 0:
        return np.zeros((k, d)), np.zeros(k), 0.0
    if _use_jit(X, xsq, w):
        step = chunk_rows(d, k, X.itemsize, LLOYD_MAX_ROWS)
        c2, csq = _centre_terms_t(centres, X.dtype)
        flat, best, lab = _lloyd_buffers(k, step, X.dtype)
        Xt = torch.from_numpy(X)
        acc_sums, acc_counts = np.zeros((k, d)), np.zeros(k)
        weights = _NO_WEIGHTS if w is None else np.asarray(w, dtype=np.float64)
        inertia = 0.0
        fused = _JIT["lloyd"]
        for s in range(0, n, step):
            xc = Xt[s : s + step]
            m = xc.shape[0]
            block = flat[: k * m].view(k, m)
            torch.addmm(csq, c2, xc.T, out=block)
            wseg = weights if w is None else weights[s : s + step]
            inertia += fused(
                block.numpy(), xsq[s : s + step], X[s : s + step], wseg, w is not None, acc_sums, acc_counts, best, lab
            )
        return acc_sums, acc_counts, inertia
    return _lloyd_partial_torch(X, xsq, w, centres)


def _lloyd_partial_torch(X: Any, xsq: Any, w: Any, centres: Any) -> tuple[Any, Any, float]:
    """The same step in torch ops only (CPU tensors, or CUDA tensors for CuPy input): min, index_add_, bincount.

    The sums accumulate in float64, as the NumPy path's do (float32 atomics over a million rows drifted 1.6e-3)."""
    Xt, xsqt = _t(X), _t(xsq)
    k, d = centres.shape
    dev = Xt.device
    sums = torch.zeros((k, d), dtype=torch.float64, device=dev)
    counts = torch.zeros(k, dtype=torch.float64, device=dev)
    inertia = torch.zeros((), dtype=torch.float64, device=dev)
    wt = None if w is None else _t(w)
    C = _t(centres).to(device=dev, dtype=Xt.dtype)
    ct, csq = (-2.0 * C).T.contiguous(), (C * C).sum(1)
    step = tensor_chunk_rows(Xt, d, k)
    for s in range(0, Xt.shape[0], step):
        xc = Xt[s : s + step]
        dist = torch.addmm(csq, xc, ct)
        best, labels = dist.min(1)
        best += xsqt[s : s + step]
        best.clamp_(min=0)
        if wt is None:
            sums.index_add_(0, labels, xc.to(torch.float64))
            counts += torch.bincount(labels, minlength=k)
            inertia += best.sum(dtype=torch.float64)
        else:
            wc = wt[s : s + step].to(torch.float64)
            sums.index_add_(0, labels, xc.to(torch.float64) * wc[:, None])
            counts += torch.bincount(labels, weights=wc, minlength=k)
            inertia += (best.to(torch.float64) * wc).sum()
    if isinstance(X, np.ndarray):
        return _np(sums), _np(counts), float(inertia)
    return sums, counts, float(inertia)


def assign(X: np.ndarray, xsq: Optional[np.ndarray], centres: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Nearest centre of each row and the squared distance to it (clipped at 0)."""
    n = X.shape[0]
    k, d = centres.shape
    if not _use_jit(X, xsq):
        return _assign_torch(X, xsq, centres)
    labels = np.empty(n, dtype=np.int32)
    dist_out = np.empty(n, dtype=X.dtype)
    if n == 0:
        return labels, dist_out
    if xsq is None:
        xsq = row_sq_norms(X)
    step = chunk_rows(d, k, X.itemsize, LLOYD_MAX_ROWS)
    c2, csq = _centre_terms_t(centres, X.dtype)
    flat, best, lab = _lloyd_buffers(k, step, X.dtype)
    Xt = torch.from_numpy(X)
    fused = _JIT["assign"]
    for s in range(0, n, step):
        xc = Xt[s : s + step]
        m = xc.shape[0]
        block = flat[: k * m].view(k, m)
        torch.addmm(csq, c2, xc.T, out=block)
        fused(block.numpy(), xsq[s : s + step], best, lab, dist_out[s : s + step], labels[s : s + step])
    return labels, dist_out


def _assign_torch(X: Any, xsq: Any, centres: Any) -> tuple[Any, Any]:
    Xt = _t(X)
    n = Xt.shape[0]
    k, d = centres.shape
    labels = torch.empty(n, dtype=torch.int32, device=Xt.device)
    dist_out = torch.empty(n, dtype=Xt.dtype, device=Xt.device)
    if n:
        xsqt = _t(xsq) if xsq is not None else (Xt * Xt).sum(1)
        C = _t(centres).to(device=Xt.device, dtype=Xt.dtype)
        ct, csq = (-2.0 * C).T.contiguous(), (C * C).sum(1)
        step = tensor_chunk_rows(Xt, d, k)
        for s in range(0, n, step):
            dist = torch.addmm(csq, Xt[s : s + step], ct)
            best, lab = dist.min(1)
            best += xsqt[s : s + step]
            dist_out[s : s + step] = best.clamp_(min=0)
            labels[s : s + step] = lab
    if isinstance(X, np.ndarray):
        return _np(labels), _np(dist_out)
    return labels, dist_out


def column_sums(X: Any) -> np.ndarray:
    """Per-column sums in float64, on the host (a device block sums where it lives)."""
    if isinstance(X, torch.Tensor):
        return _np(X.sum(0, dtype=torch.float64))
    return X.sum(axis=0, dtype=np.float64)


def shifted(X: Any, mean: np.ndarray) -> Any:
    """X - mean in X's dtype, where X lives (a new array)."""
    if isinstance(X, torch.Tensor):
        return X - torch.as_tensor(mean, dtype=X.dtype, device=X.device)
    return X - mean.astype(X.dtype)


def total(v: Any) -> float:
    """The sum of a vector in float64."""
    if isinstance(v, torch.Tensor):
        return float(v.sum(dtype=torch.float64))
    return float(v.sum(dtype=np.float64))


def exact_inertia(X: Any, w: Any, centres: np.ndarray, labels: Any) -> float:
    """Sum of w * ||x - c_label||^2 from the differences themselves (the reported inertia, as scikit-learn's)."""
    if isinstance(X, torch.Tensor):
        return _exact_inertia_torch(X, w, centres, labels)
    total = 0.0
    C = np.asarray(centres, dtype=X.dtype)
    step = chunk_rows(X.shape[1], 1, X.itemsize)
    for s in range(0, X.shape[0], step):
        diff = X[s : s + step] - C[labels[s : s + step]]
        sq = np.einsum("ij,ij->i", diff, diff)
        total += float(np.dot(sq, w[s : s + step]) if w is not None else sq.sum(dtype=np.float64))
    return total


def _exact_inertia_torch(X: torch.Tensor, w: Any, centres: np.ndarray, labels: torch.Tensor) -> float:
    C = torch.as_tensor(np.asarray(centres), dtype=X.dtype, device=X.device)
    lab = labels.to(device=X.device, dtype=torch.int64)
    wt = None if w is None else _t(w).to(device=X.device, dtype=torch.float64)
    acc = torch.zeros((), dtype=torch.float64, device=X.device)
    step = tensor_chunk_rows(X, X.shape[1], 1)
    for s in range(0, X.shape[0], step):
        diff = X[s : s + step] - C[lab[s : s + step]]
        sq = (diff * diff).sum(1, dtype=torch.float64)
        acc += sq.sum() if wt is None else (sq * wt[s : s + step]).sum()
    return float(acc)


def min_sq_dist(X: np.ndarray, xsq: Optional[np.ndarray], centres: np.ndarray) -> np.ndarray:
    return assign(X, xsq, centres)[1]


def farthest(
    X: np.ndarray, xsq: np.ndarray, w: Optional[np.ndarray], centres: np.ndarray, count: int, offset: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The `count` rows farthest from their nearest centre: (distance, global index, row, weight, label)."""
    labels, dist = (device.host(a) for a in assign(X, xsq, centres))
    count = min(count, X.shape[0])
    if count == 0:
        z = np.zeros(0)
        rows = np.zeros((0, X.shape[1]), numpy_dtype(X.dtype))
        return z, z.astype(np.int64), rows, z, z.astype(np.int32)
    far = np.argpartition(dist, -count)[-count:]
    weights = np.ones(count) if w is None else np.asarray(device.host(w)[far], dtype=np.float64)
    picked = device.host(X[torch.from_numpy(far).to(X.device)]) if isinstance(X, torch.Tensor) else X[far]
    return dist[far].astype(np.float64), far.astype(np.int64) + offset, picked, weights, labels[far]


def gram_partial(
    X: np.ndarray, y: np.ndarray, w: Optional[np.ndarray], x_mean: np.ndarray, y_mean: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Centred, weighted X^T W X and X^T W y of a block, accumulated in float64 chunk by chunk."""
    d = X.shape[1]
    t = y.shape[1]
    G = np.zeros((d, d))
    b = np.zeros((d, t))
    step = chunk_rows(d, t, 8)
    for s in range(0, X.shape[0], step):
        xc = np.asarray(X[s : s + step], dtype=np.float64) - x_mean
        yc = np.asarray(y[s : s + step], dtype=np.float64) - y_mean
        if w is not None:
            wc = np.asarray(w[s : s + step], dtype=np.float64)[:, None]
            G += xc.T @ (xc * wc)
            b += xc.T @ (yc * wc)
        else:
            G += xc.T @ xc
            b += xc.T @ yc
    return G, b


KNN_QUERY_ROWS = 128
KNN_INDEX_ROWS = 1024
"""Queries x index rows per distance block (512 KiB in float32; measured best of 64-512 x 1024-8192):
a block is scanned right after the product
that wrote it, so it is read back from cache; the index chunk is the product's operand in place (no copy)."""


def knn_block(
    index: np.ndarray, index_sq: np.ndarray, queries: np.ndarray, k: int, offset: int, metric: str
) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest rows of `index` for each query: (squared euclidean or cosine distance, global index).

    Fewer than k columns when the block holds fewer than k rows. Queries go
    in blocks; each block's distances to one index chunk are one product,
    merged into every query's running k best by a compiled insertion pass
    (no row is sorted). Euclidean distances of the winners are then computed
    again from the differences in float64, so the reported values do not
    carry the product's cancellation error.
    """
    m = queries.shape[0]
    n = index.shape[0]
    kk = min(k, n)
    if kk == 0 or m == 0:
        return np.empty((m, kk), dtype=np.float64), np.empty((m, kk), dtype=np.int64)
    if not _use_jit(index, index_sq, queries):
        return _knn_block_torch(index, index_sq, queries, kk, offset, metric)
    It = torch.from_numpy(index)
    Q = np.ascontiguousarray(queries, dtype=index.dtype)
    Qt = torch.from_numpy(Q)
    isq = torch.from_numpy(np.ascontiguousarray(index_sq, dtype=index.dtype))
    cosine = metric == "cosine"
    if cosine:
        tiny = 1e-300 if index.dtype == np.float64 else 1e-30
        It = It / torch.sqrt(isq).clamp_(min=tiny)[:, None]
        Qt = Qt / torch.linalg.vector_norm(Qt, dim=1).clamp_(min=1e-30)[:, None]
    qb, cb = min(KNN_QUERY_ROWS, m), min(KNN_INDEX_ROWS, n)
    flat = _WORK.get(("knn", qb, cb, index.dtype.str), lambda: torch.empty(qb * cb, dtype=It.dtype))
    best_d = np.empty((m, kk), dtype=index.dtype)
    best_i = np.empty((m, kk), dtype=np.int64)
    insert = _JIT["topk"]
    for q0 in range(0, m, qb):
        qs = Qt[q0 : q0 + qb]
        bd, bi = best_d[q0 : q0 + qb], best_i[q0 : q0 + qb]
        bd.fill(np.inf)
        bi.fill(0)
        for c0 in range(0, n, cb):
            chunk = It[c0 : c0 + cb]
            block = flat[: qs.shape[0] * chunk.shape[0]].view(qs.shape[0], chunk.shape[0])
            if cosine:
                torch.mm(qs, chunk.T, out=block).neg_()
            else:  # ||x||^2 - 2 q.x: the query's own norm does not change its order
                torch.addmm(isq[c0 : c0 + cb], qs, chunk.T, alpha=-2.0, out=block)
            insert(block.numpy(), c0, bd, bi)
    if cosine:
        dist = 1.0 + best_d.astype(np.float64)
    else:
        diff = Q[:, None, :].astype(np.float64) - index[best_i].astype(np.float64)
        dist = np.einsum("ijk,ijk->ij", diff, diff)
        order = np.lexsort((best_i, dist), axis=1)
        rows = np.arange(m)[:, None]
        dist, best_i = dist[rows, order], best_i[rows, order]
    return dist, best_i + offset


def _knn_block_torch(
    index: Any, index_sq: Any, queries: Any, kk: int, offset: int, metric: str
) -> tuple[np.ndarray, np.ndarray]:
    """The torch path (CPU tensors, or CUDA tensors for CuPy input): a product per query block, then topk."""
    It = _t(index)
    Qt = _t(queries).to(device=It.device, dtype=It.dtype)
    isq = _t(index_sq).to(device=It.device, dtype=It.dtype)
    m = Qt.shape[0]
    if metric == "cosine":
        tiny = 1e-300 if It.dtype == torch.float64 else 1e-30
        It = It / torch.sqrt(isq).clamp_(min=tiny)[:, None]
        Qt = Qt / torch.linalg.vector_norm(Qt, dim=1).clamp_(min=1e-30)[:, None]
    dist_out = torch.empty((m, kk), dtype=torch.float64, device=It.device)
    idx_out = torch.empty((m, kk), dtype=torch.int64, device=It.device)
    step = max(64, chunk_rows(It.shape[0], 0, It.element_size()) // 4)
    for s in range(0, m, step):
        q = Qt[s : s + step]
        if metric == "cosine":
            dist = torch.mm(q, It.T).neg_().add_(1.0)
        else:
            dist = torch.addmm(isq, q, It.T, alpha=-2.0)
            dist += (q * q).sum(1, keepdim=True)
            dist.clamp_(min=0)
        vals, pos = torch.topk(dist, kk, dim=1, largest=False, sorted=True)
        if metric != "cosine":  # the winners' distances again from the differences, in float64, as the NumPy path
            diff = q[:, None, :].to(torch.float64) - It[pos].to(torch.float64)
            vals = (diff * diff).sum(-1)
            by_index = torch.argsort(pos, dim=1, stable=True)  # then (distance, index) order, as its lexsort
            vals, pos = vals.gather(1, by_index), pos.gather(1, by_index)
            by_distance = torch.argsort(vals, dim=1, stable=True)
            vals, pos = vals.gather(1, by_distance), pos.gather(1, by_distance)
        dist_out[s : s + step] = vals
        idx_out[s : s + step] = pos + offset
    return _np(dist_out), _np(idx_out)


def merge_topk(
    parts: list[tuple[np.ndarray, np.ndarray]], k: int, extra: Optional[list[np.ndarray]] = None
) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """Keep the k smallest distances over the blocks' candidates (ties: smaller global index first)."""
    dist = np.concatenate([p[0] for p in parts], axis=1)
    idx = np.concatenate([p[1] for p in parts], axis=1)
    order = np.lexsort((idx, dist), axis=1)[:, :k] if dist.shape[1] else np.zeros((dist.shape[0], 0), np.int64)
    rows = np.arange(dist.shape[0])[:, None]
    picked = None
    if extra is not None:
        picked = np.concatenate(extra, axis=1)[rows, order]
    return dist[rows, order], idx[rows, order], picked
