"""Lloyd iterations that skip the rows whose nearest centre provably did not move (Hamerly 2010).

Each row keeps its label, an upper bound on the distance to its centre and
a lower bound on the distance to any other centre. After the centres move,
the bounds move by the centres' shifts; a row whose upper bound is below
max(lower bound, half the gap from its centre to the nearest other centre)
keeps its label without a distance computation. Only the rest go through
the chunked product and the argmin, and a row that changes label moves its
values from one centre's sums to the other's: an iteration where few rows
move reads little more than the bounds. Each iteration's labels are
Lloyd's (up to float rounding of near ties, as Lloyd's own product gives),
so its centres are too, and empty clusters are relocated between
iterations as before (the bounds follow any centre that moves).

The state lives with the block (this process's own arrays), so this path
serves one process and SPMD ranks; Dask blocks, whose tasks may run on any
worker, keep the plain Lloyd step.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from hpdl.ml import kernels

__all__ = ["usable", "State", "moves_between", "partial", "warm_up"]

FULL_PASS_SHARE = 0.25
"""When more than this share of a block's rows fail the bounds' test, every row goes through the product (no exact
distances, no copying out). A fit of `hpdl bench ml`'s K-Means data (500k x 32 x 16 float32, 34 iterations, one
process) took 449-471 ms for any share from 0.15 to 1.0, least at 0.25."""

ROUNDING_TERMS = 8
"""The lower bounds are lowered by (features + this) x eps x (||x||^2 + ||c||^2), a bound on the rounding error of
||x||^2 - 2 x.c + ||c||^2 in the data's precision, so that rounding never makes them too high."""


def usable(X: Any, xsq: Any, w: Any) -> bool:
    """The bounds need the compiled loops and NumPy blocks of this process."""
    return kernels.USE_BOUNDS and kernels._use_jit(X, xsq, w) and isinstance(X, np.ndarray)


class State:
    """What a block keeps between iterations: labels (-1 before the first), both bounds, its sums and weights, and
    its rows of non-zero weight per centre (exact, so that an emptied centre is exactly empty)."""

    def __init__(self, n: int, k: int, d: int):
        self.labels = np.full(n, -1, np.int32)
        self.upper = np.zeros(n)
        self.lower = np.zeros(n)
        self.sums = np.zeros((k, d))
        self.counts = np.zeros(k)
        self.members = np.zeros(k, np.int64)


def moves_between(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """How far each centre moved (Euclidean, float64)."""
    return np.sqrt(((new.astype(np.float64) - old.astype(np.float64)) ** 2).sum(1))


def _half_gaps(C: np.ndarray) -> np.ndarray:
    """Half the distance from each centre to its nearest other centre (inf for one centre)."""
    k = C.shape[0]
    if k == 1:
        return np.full(1, np.inf)
    sq = (C * C).sum(1)
    both = sq[:, None] + sq[None, :]
    slack = (C.shape[1] + ROUNDING_TERMS) * float(np.finfo(np.float64).eps) * both  # the product form's rounding
    gaps = np.maximum(both - 2.0 * (C @ C.T) - slack, 0.0)
    np.fill_diagonal(gaps, np.inf)
    return 0.5 * np.sqrt(gaps.min(1))


def partial(
    X: np.ndarray,
    xsq: np.ndarray,
    w: Optional[np.ndarray],
    centres: np.ndarray,
    moves: Optional[np.ndarray],
    state: State,
    full_pass_share: float = FULL_PASS_SHARE,
) -> tuple[np.ndarray, np.ndarray]:
    """One Lloyd E-step on a block with bounds: per-centre sums and weights (float64).

    `moves` is None on a run's first iteration (every row is assigned by
    the product) and the centres' shifts since the previous call after it.
    The sums are kept up to date as rows change label, so a row that keeps
    its label costs a few comparisons and no read of its values.
    """
    k, d = centres.shape
    n = X.shape[0]
    if n == 0:
        return np.zeros((k, d)), np.zeros(k)
    C64 = np.ascontiguousarray(centres, dtype=np.float64)
    if moves is None:
        _assign(X, xsq, w, centres, C64, None, state)
    else:
        order = np.argsort(moves)
        top = float(moves[order[-1]])
        second = float(moves[order[-2]]) if k > 1 else 0.0
        half = _half_gaps(C64)
        todo = np.empty(n, np.int64)
        count = kernels._JIT["bounds_check"](
            state.labels, state.upper, state.lower, moves, top, second, int(order[-1]), half, todo
        )
        if count > full_pass_share * n:
            _assign(X, xsq, w, centres, C64, None, state)
        elif count:
            _assign(X, xsq, w, centres, C64, (todo[:count], half), state)
    return state.sums.copy(), state.counts.copy()


def warm_up() -> None:
    """Compile (or load from numba's cache) the bounds' loops, as `kernels.warm_up` does the others'.

    Each runs once on two rows, float32 and float64, with and without
    weights: the first pass, then a pass where every row is doubtful but
    its exact distance clears it.
    """
    for dtype in (np.float32, np.float64):
        two = np.array([[0.0, 0.0], [1.0, 1.0]], dtype=dtype)
        for w in (None, np.ones(2)):
            if not usable(two, None, w):
                return
            state = State(2, 2, 2)
            partial(two, kernels.row_sq_norms(two), w, two, None, state)
            partial(two, kernels.row_sq_norms(two), w, two, np.full(2, 10.0), state, full_pass_share=1.0)


def _assign(
    X: np.ndarray,
    xsq: np.ndarray,
    w: Optional[np.ndarray],
    centres: np.ndarray,
    C64: np.ndarray,
    doubtful: Optional[tuple[np.ndarray, np.ndarray]],
    state: State,
) -> None:
    """Nearest centre and fresh bounds, chunk by chunk through the product: for every row, or for the
    `doubtful` rows (indices, half gaps) that one exact distance to their own centre does not clear."""
    k, d = centres.shape
    step = kernels.chunk_rows(d, k, X.itemsize, kernels.LLOYD_MAX_ROWS)
    c2, csq = kernels._centre_terms_t(centres, X.dtype)
    flat, b1, jl = kernels._lloyd_buffers(k, step, X.dtype)
    b2 = np.empty(step, X.dtype)
    err = (d + ROUNDING_TERMS) * float(np.finfo(X.dtype).eps)
    cmax = float(csq.max())
    weights = kernels._NO_WEIGHTS if w is None else np.asarray(w, dtype=np.float64)
    loops = kernels._JIT
    if doubtful is not None:
        rows, half = doubtful
        picked, picked_sq, picked_at = np.empty((step, d), X.dtype), np.empty(step, X.dtype), np.empty(step, np.int64)
    total = X.shape[0] if doubtful is None else rows.shape[0]
    for s in range(0, total, step):
        if doubtful is None:
            m = min(step, total - s)
            at, part, part_sq = np.arange(s, s + m), X[s : s + m], xsq[s : s + m]
        else:
            m = loops["bounds_tighten"](
                X,
                xsq,
                rows[s : s + step],
                state.labels,
                state.upper,
                state.lower,
                half,
                C64,
                picked,
                picked_sq,
                picked_at,
            )
            if m == 0:
                continue
            at, part, part_sq = picked_at[:m], picked[:m], picked_sq[:m]
        block = flat[: k * m].view(k, m)
        torch.addmm(csq, c2, torch.from_numpy(part).T, out=block)
        loops["bounds_reassign"](
            block.numpy(),
            part_sq,
            at,
            X,
            weights,
            w is not None,
            err,
            cmax,
            state.labels,
            state.upper,
            state.lower,
            state.sums,
            state.counts,
            state.members,
            b1,
            b2,
            jl,
        )
