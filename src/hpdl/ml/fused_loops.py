"""The fused loops of the K-Means and k-NN kernels, compiled by numba (imported only where numba is installed).

They live at module level, not in a closure: numba's on-disk cache keys a
function by its code and the values of its closure cells, and a compiled
function in a cell (`lloyd_step` calling `argmin_columns`) hashes differently
in every process, so each process compiled the loops again (3-4 s) and added
a cache entry that no other process could use.
"""

from __future__ import annotations

import math

from numba import njit

__all__ = [
    "argmin_columns",
    "lloyd_step",
    "assign_step",
    "topk_insert",
    "bounds_check",
    "bounds_tighten",
    "bounds_reassign",
]


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


@njit(cache=True, nogil=True, boundscheck=False, fastmath={"reassoc", "contract"})
def _exact_sq(X, i, C, a):  # type: ignore[no-untyped-def]
    """||X[i] - C[a]||^2 in float64 from the differences (no cancellation, unlike the product form).

    Reassociation lets the sum vectorise; in float64 its rounding is far below the data's.
    """
    total = 0.0
    for f in range(X.shape[1]):
        diff = X[i, f] - C[a, f]
        total += diff * diff
    return total


@njit(cache=True, nogil=True, boundscheck=False)
def bounds_check(lab, upper, lower, moves, top, second, top_at, half, todo):  # type: ignore[no-untyped-def]
    """Hamerly's test per row after the centres moved; the rows it cannot clear go to `todo` (their count returned).

    The upper bound grows by its own centre's move, the lower bound shrinks by
    the largest move of any other centre; a row whose upper bound stays below
    max(lower, half the gap to its centre's nearest neighbour) keeps its
    label. Only the bounds are read here, not the rows.
    """
    count = 0
    for i in range(lab.shape[0]):
        a = lab[i]
        u = upper[i] + moves[a]
        upper[i] = u
        low = lower[i] - (second if a == top_at else top)
        lower[i] = low
        if u > max(low, half[a]):
            todo[count] = i
            count += 1
    return count


@njit(cache=True, nogil=True, boundscheck=False)
def bounds_tighten(X, xsq, rows, lab, upper, lower, half, C, picked, picked_sq, picked_at):  # type: ignore[no-untyped-def]
    """The exact distance to its own centre for each of `rows`; those still not cleared are copied out (count returned).

    `picked`, `picked_sq` and `picked_at` receive the rows, their squared
    norms and their indices, ready for the distance product.
    """
    kept = 0
    d = X.shape[1]
    for t in range(rows.shape[0]):
        i = rows[t]
        a = lab[i]
        u = math.sqrt(_exact_sq(X, i, C, a))
        upper[i] = u
        if u > max(lower[i], half[a]):
            for f in range(d):
                picked[kept, f] = X[i, f]
            picked_sq[kept] = xsq[i]
            picked_at[kept] = i
            kept += 1
    return kept


@njit(cache=True, nogil=True, boundscheck=False)
def bounds_reassign(DT, xsq, rows, X, w, use_w, err, cmax, lab, upper, lower, sums, counts, members, b1, b2, jl):  # type: ignore[no-untyped-def]
    """Labels and bounds of the rows `rows` from their distance block (k x m, ||c||^2 - 2 c.x), and the sums' update.

    Both bounds allow for the product's rounding (`err` x (||x||^2 + `cmax`,
    the largest ||c||^2)): the upper is raised by it, the lower lowered, so
    rounding never lets a row skip a test it should take. A row whose label
    changes moves its (weighted) values from its old centre's sums to the
    new one's; a row without a label yet (-1) only adds. `members` counts
    the rows of non-zero weight per centre exactly: a centre left without
    them gets sums and weight of exactly 0 (subtracted fractional weights
    would leave a residue that hides an empty cluster).
    """
    k, m = DT.shape
    d = X.shape[1]
    for t in range(m):
        b1[t] = DT[0, t]
        b2[t] = math.inf
        jl[t] = 0
    for j in range(1, k):
        for t in range(m):
            v = DT[j, t]
            best = b1[t]
            less = v < best
            b2[t] = best if less else min(b2[t], v)
            b1[t] = v if less else best
            jl[t] = j if less else jl[t]
    for t in range(m):
        i = rows[t]
        a = jl[t]
        slack = err * (xsq[t] + cmax)
        near = b1[t] + xsq[t] + slack
        upper[i] = math.sqrt(near) if near > 0 else 0.0
        far = b2[t] + xsq[t] - slack
        lower[i] = math.sqrt(far) if far > 0 else 0.0
        old = lab[i]
        if a != old:
            lab[i] = a
            wi = w[i] if use_w else 1.0
            counts[a] += wi
            if wi != 0:
                members[a] += 1
            if old >= 0:
                counts[old] -= wi
                if wi != 0:
                    members[old] -= 1
                for f in range(d):
                    value = wi * X[i, f]
                    sums[a, f] += value
                    sums[old, f] -= value
                if members[old] == 0:
                    counts[old] = 0.0
                    for f in range(d):
                        sums[old, f] = 0.0
            else:
                for f in range(d):
                    sums[a, f] += wi * X[i, f]
    return m
