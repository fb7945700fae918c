"""The fused loops of the K-Means and k-NN kernels, compiled by numba (imported only where numba is installed).

They live at module level, not in a closure: numba's on-disk cache keys a
function by its code and the values of its closure cells, and a compiled
function in a cell (`lloyd_step` calling `argmin_columns`) hashes differently
in every process, so each process compiled the loops again (3-4 s) and added
a cache entry that no other process could use.
"""

from __future__ import annotations

from numba import njit

__all__ = ["argmin_columns", "lloyd_step", "assign_step", "topk_insert"]


@njit(cache=True, nogil=True, boundscheck=False)
def argmin_columns(DT, best, lab):  # type: ignore[no-untyped-def]
    """Per column of DT (k x m): the smallest value and its row; the first minimum wins, as np.argmin.

    Written as selects over contiguous columns so that LLVM vectorises it across rows.
    """
    k, m = DT.shape
    for i in range(m):
        best[i] = DT[0, i]
        lab[i] = 0
    for j in range(1, k):
        for i in range(m):
            v = DT[j, i]
            b = best[i]
            less = v < b
            best[i] = v if less else b
            lab[i] = j if less else lab[i]


@njit(cache=True, nogil=True, boundscheck=False)
def lloyd_step(DT, xsq, X, w, use_w, sums, counts, best, lab):  # type: ignore[no-untyped-def]
    """argmin over the centres, then the per-centre sums and weights and the inertia, in one pass."""
    m = DT.shape[1]
    d = X.shape[1]
    argmin_columns(DT, best, lab)
    inertia = 0.0
    for i in range(m):
        label = lab[i]
        dist = best[i] + xsq[i]
        if dist < 0:
            dist = 0.0
        if use_w:
            wi = w[i]
            inertia += wi * dist
            counts[label] += wi
            for f in range(d):
                sums[label, f] += wi * X[i, f]
        else:
            inertia += dist
            counts[label] += 1.0
            for f in range(d):
                sums[label, f] += X[i, f]
    return inertia


@njit(cache=True, nogil=True, boundscheck=False)
def assign_step(DT, xsq, best, lab, dist_out, lab_out):  # type: ignore[no-untyped-def]
    argmin_columns(DT, best, lab)
    for i in range(DT.shape[1]):
        dist = best[i] + xsq[i]
        dist_out[i] = dist if dist > 0 else 0.0
        lab_out[i] = lab[i]


@njit(cache=True, nogil=True, boundscheck=False)
def topk_insert(D, col0, best_d, best_i):  # type: ignore[no-untyped-def]
    """Merge a distance block (queries x index rows) into each query's running k best (ascending).

    A candidate enters only when it beats the current k-th, so most of the
    block costs one comparison; ties keep the earlier (smaller) index.
    """
    m, c = D.shape
    k = best_d.shape[1]
    for q in range(m):
        threshold = best_d[q, k - 1]
        for j in range(c):
            v = D[q, j]
            if v < threshold:
                p = k - 1
                while p > 0 and best_d[q, p - 1] > v:
                    best_d[q, p] = best_d[q, p - 1]
                    best_i[q, p] = best_i[q, p - 1]
                    p -= 1
                best_d[q, p] = v
                best_i[q, p] = col0 + j
                threshold = best_d[q, k - 1]
