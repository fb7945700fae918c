"""Dask arrays as shards: the kernels run per block on the workers; only small partial results travel.

A Dask array's row blocks become the blocks of `Shards`. Each operation
builds one task per block (`fn(block, meta, *args)`) and computes them on the
current scheduler (the `dask.distributed` Client when one exists). Prepared
blocks (for example K-Means' centred rows and their norms) are persisted on
the workers, so iterations do not recompute them; partial results (k x d
sums, Gram matrices, k candidates per query) are combined on the client. The
whole array is never pulled to the client.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from hpdl.ml.base import BlockFn, Shards

__all__ = ["DaskShards", "map_rows"]

SHIP_ONCE_BYTES = 64 * 1024
"""Arguments larger than this go to the workers once as their own key instead of inside every task."""


def _pack(*arrays: Any) -> tuple:
    return tuple(arrays)


def _nonfinite(block: tuple, meta: Any) -> tuple:
    X = block[0]
    return (float(np.isnan(X).sum()), float(np.isinf(X).sum()))


def _shared_args(args: Sequence[Any]) -> list[Any]:
    import dask

    return [dask.delayed(a, pure=True) if isinstance(a, np.ndarray) and a.nbytes > SHIP_ONCE_BYTES else a for a in args]


def _aligned(value: Any, X: Any, name: str) -> Any:
    """A companion of X (weights, targets) as a Dask array chunked like X's rows, or None."""
    import dask.array as da

    if value is None:
        return None
    arr = value if hasattr(value, "to_delayed") else da.from_array(np.asarray(value), chunks=-1)
    if arr.shape[0] != X.shape[0]:
        raise ValueError(f"{name} has {arr.shape[0]} rows but X has {X.shape[0]}; they must match")
    chunks = (X.chunks[0],) + tuple((s,) for s in arr.shape[1:])
    return arr.rechunk(chunks)


class DaskShards(Shards):
    """The row blocks of a Dask array (plus row-aligned companions) as delayed tuples."""

    def __init__(self, parts: list[Any], sizes: list[int], n_features: int, dtype: Any):
        self.parts = parts
        self.sizes = [int(s) for s in sizes]
        self.n_samples = int(sum(self.sizes))
        self.n_features = int(n_features)
        self.dtype = np.dtype(dtype)

    @classmethod
    def build(cls, X: Any, extra: Sequence[Any], *, dtype: Any, estimator: str) -> DaskShards:
        import dask

        if X.ndim != 2:
            raise ValueError(
                f"Expected 2D array, got {X.ndim}D array instead: reshape your data with X.reshape(-1, 1) if it "
                f"has a single feature or X.reshape(1, -1) if it contains a single sample ({estimator})."
            )
        allowed = [np.dtype(d) for d in (dtype if isinstance(dtype, (list, tuple)) else [dtype])]
        if X.dtype not in allowed:
            if X.dtype.kind not in "biuf":
                raise TypeError(f"{estimator}: a Dask array of dtype {X.dtype} is not numeric; cast it first")
            X = X.astype(allowed[0])
        if any(np.isnan(c) for c in X.chunks[0]):
            X = X.compute_chunk_sizes()
        X = X.rechunk({1: -1})
        if X.shape[0] == 0:
            raise ValueError(f"Found array with 0 sample(s) (shape={X.shape}) while a minimum of 1 is required.")
        companions = [_aligned(e, X, f"argument {i + 1}") for i, e in enumerate(extra)]
        blocks = [b for b in X.to_delayed().ravel()]
        columns = [[None] * len(blocks) if c is None else list(c.to_delayed().ravel()) for c in companions]
        parts = [dask.delayed(_pack, pure=True)(b, *[col[i] for col in columns]) for i, b in enumerate(blocks)]
        shards = cls(parts, list(X.chunks[0]), X.shape[1], X.dtype)
        nans, infs = shards.reduce(_nonfinite)
        if nans or infs:
            raise ValueError(f"Input X contains {'NaN' if nans else 'infinity'}.")
        return shards

    def _tasks(self, fn: BlockFn, args: Sequence[Any]) -> list[Any]:
        import dask

        shared = _shared_args(args)
        offsets = self.offsets
        return [dask.delayed(fn, pure=True)(p, (i, offsets[i]), *shared) for i, p in enumerate(self.parts)]

    def reduce(self, fn: BlockFn, *args: Any) -> list[np.ndarray]:
        import dask

        results = dask.compute(*self._tasks(fn, args))
        total = [np.array(r, dtype=np.float64, copy=True) for r in results[0]]
        for part in results[1:]:
            for acc, value in zip(total, part):
                acc += value
        return total

    def gather(self, fn: BlockFn, *args: Any) -> list[Any]:
        import dask

        return list(dask.compute(*self._tasks(fn, args)))

    def map(self, fn: BlockFn, *args: Any, dtype: Any, tail: tuple = ()) -> Any:
        import dask.array as da

        pieces = [
            da.from_delayed(task, shape=(n, *tail), dtype=dtype) for task, n in zip(self._tasks(fn, args), self.sizes)
        ]
        return da.concatenate(pieces, axis=0)

    def transform(self, fn: BlockFn, *args: Any) -> Shards:
        import dask

        persisted = list(dask.persist(*self._tasks(fn, args)))
        return DaskShards(persisted, self.sizes, self.n_features, self.dtype)


def _rows_block(block: Any, fn: BlockFn, args: tuple) -> Any:
    return fn((block,), (0, 0), *args)


def map_rows(X: Any, fn: BlockFn, *args: Any, dtype: Any, tail: tuple = ()) -> Any:
    """`fn` on each row block of a Dask array X, lazily, as a Dask array of len(X) rows (x `tail`)."""
    X = X.rechunk({1: -1})
    if tail:
        return X.map_blocks(_rows_block, fn, args, dtype=dtype, chunks=(X.chunks[0], *((t,) for t in tail)))
    return X.map_blocks(_rows_block, fn, args, dtype=dtype, drop_axis=1, chunks=(X.chunks[0],))
