"""Where the data lives: one array, one shard per MPI rank, or the blocks of a Dask array.

Every estimator is written once against `Shards`, a list of row blocks with
three operations:

- `reduce(fn, *args)`: the sum over blocks of `fn(block, meta, *args)` (a
  tuple of arrays), known everywhere: one allreduce on MPI, one compute of
  small partial results on Dask.
- `gather(fn, *args)`: every block's result, in block order, known everywhere.
- `map(fn, *args)`: a per-row result in the input's own form (an array, this
  rank's shard, a Dask array).

A block is a tuple of arrays that share rows (X, then weights, targets, ...);
`meta` is `(block index, global offset of its first row)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from sklearn.utils.validation import check_array

from hpdl.errors import HpdlError

__all__ = [
    "Shards",
    "LocalShards",
    "SpmdShards",
    "ShardMismatchError",
    "is_dask_array",
    "validate_block",
    "agree_on_layout",
]

Block = tuple
Meta = tuple[int, int]
BlockFn = Callable[..., Any]


class ShardMismatchError(HpdlError, ValueError):
    """Ranks passed shards that cannot belong to one data set (feature counts or dtypes differ), or one failed."""


def numpy_dtype(dtype: Any) -> np.dtype:
    """A block's dtype as NumPy names it (a torch tensor's too: device blocks are tensors)."""
    try:
        return np.dtype(dtype)
    except TypeError:
        return np.dtype(str(dtype).removeprefix("torch."))


def is_dask_array(x: Any) -> bool:
    mod = type(x).__module__
    return mod.startswith("dask.") and hasattr(x, "chunks") and hasattr(x, "to_delayed")


def validate_block(
    X: Any, *, dtype: Any, allow_empty: bool, estimator: str, ensure_2d: bool = True, name: str = "X"
) -> np.ndarray:
    """scikit-learn's checks (finite, 2-D, numeric) on one process's data; an empty shard may be allowed."""
    return check_array(
        X,
        dtype=dtype,
        order="C",
        ensure_2d=ensure_2d,
        ensure_min_samples=0 if allow_empty else 1,
        estimator=estimator,
        input_name=name,
    )


class Shards(ABC):
    """The row blocks of one data set and the collective operations over them."""

    n_samples: int
    n_features: int
    dtype: np.dtype
    sizes: list[int]
    """Rows per block, in block order."""

    @property
    def offsets(self) -> list[int]:
        return [int(o) for o in np.concatenate([[0], np.cumsum(self.sizes)[:-1]])] if self.sizes else []

    @property
    def distributed(self) -> bool:
        return True

    holds_blocks = False
    """True where the blocks are this process's own arrays, so state kept beside them lasts across calls."""

    @abstractmethod
    def reduce(self, fn: BlockFn, *args: Any) -> list[np.ndarray]:
        """Sum of `fn(block, meta, *args)` over blocks (each result a tuple of arrays or numbers)."""

    @abstractmethod
    def gather(self, fn: BlockFn, *args: Any) -> list[Any]:
        """`[fn(block, meta, *args) for every block]`, known to every caller."""

    @abstractmethod
    def map(self, fn: BlockFn, *args: Any, dtype: Any, tail: tuple = ()) -> Any:
        """`fn(block, meta, *args)` per block, as rows of the input's own form."""

    @abstractmethod
    def transform(self, fn: BlockFn, *args: Any) -> Shards:
        """New shards whose blocks are `fn(block, meta, *args)` (kept where the data is)."""

    def reduce_one(self, fn: BlockFn, *args: Any) -> np.ndarray:
        return self.reduce(lambda b, m, *a: (fn(b, m, *a),), *args)[0]


def _sum_parts(parts: Sequence[Sequence[Any]]) -> list[np.ndarray]:
    total = [np.array(p, dtype=np.float64, copy=True) for p in parts[0]]
    for part in parts[1:]:
        for acc, value in zip(total, part):
            acc += value
    return total


@dataclass
class LocalShards(Shards):
    """One process holds everything: one block."""

    block: Block
    holds_blocks = True

    def __post_init__(self) -> None:
        X = self.block[0]
        self.n_samples, self.n_features = int(X.shape[0]), int(X.shape[1])
        self.dtype = numpy_dtype(X.dtype)
        self.sizes = [self.n_samples]

    @property
    def distributed(self) -> bool:
        return False

    def reduce(self, fn: BlockFn, *args: Any) -> list[np.ndarray]:
        return _sum_parts([fn(self.block, (0, 0), *args)])

    def gather(self, fn: BlockFn, *args: Any) -> list[Any]:
        return [fn(self.block, (0, 0), *args)]

    def map(self, fn: BlockFn, *args: Any, dtype: Any, tail: tuple = ()) -> Any:
        return fn(self.block, (0, 0), *args)

    def transform(self, fn: BlockFn, *args: Any) -> Shards:
        return LocalShards(fn(self.block, (0, 0), *args))


class SpmdShards(Shards):
    """Each rank of `comm` holds one block; reductions are one allreduce of the packed partial results."""

    holds_blocks = True

    def __init__(self, block: Block, comm: Any, sizes: list[int]):
        self.block = block
        self.comm = comm
        X = block[0]
        self.n_features = int(X.shape[1])
        self.dtype = numpy_dtype(X.dtype)
        self.sizes = list(sizes)
        self.n_samples = int(sum(sizes))
        self.meta = (comm.rank, self.offsets[comm.rank])

    def reduce(self, fn: BlockFn, *args: Any) -> list[np.ndarray]:
        part = [np.asarray(p, dtype=np.float64) for p in fn(self.block, self.meta, *args)]
        flat = np.concatenate([p.ravel() for p in part]) if part else np.zeros(0)
        flat = np.ascontiguousarray(flat)
        self.comm.allreduce(flat)  # one collective for every partial result
        out, start = [], 0
        for p in part:
            out.append(flat[start : start + p.size].reshape(p.shape))
            start += p.size
        return out

    def gather(self, fn: BlockFn, *args: Any) -> list[Any]:
        return self.comm.allgather_object(fn(self.block, self.meta, *args))

    def map(self, fn: BlockFn, *args: Any, dtype: Any, tail: tuple = ()) -> Any:
        return fn(self.block, self.meta, *args)

    def transform(self, fn: BlockFn, *args: Any) -> Shards:
        return SpmdShards(fn(self.block, self.meta, *args), self.comm, self.sizes)


def agree_on_layout(comm: Any, local: Any, estimator: str, *, allow_all_empty: bool = False) -> list[int]:
    """One small allgather: every rank's (rows, features, dtype, error); mismatches raise on every rank.

    A rank whose own validation failed does not leave the others waiting in
    the next collective: its error travels with this exchange, and every
    rank raises, naming the rank.
    """
    if isinstance(local, BaseException):
        mine: tuple = (0, -1, "", f"{type(local).__name__}: {local}")
    else:
        mine = (int(local.shape[0]), int(local.shape[1]), str(numpy_dtype(local.dtype)), "")
    table = comm.allgather_object(mine)
    failed = [(r, t[3]) for r, t in enumerate(table) if t[3]]
    if failed:
        if isinstance(local, BaseException):
            raise local
        detail = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
        raise ShardMismatchError(f"{estimator}: the input was rejected on rank(s) {[r for r, _ in failed]}: {detail}")
    for position, label in ((1, "feature counts"), (2, "dtypes")):
        values = [t[position] for t in table]
        if len(set(values)) > 1:
            groups: dict[Any, list[int]] = {}
            for r, v in enumerate(values):
                groups.setdefault(v, []).append(r)
            listing = ", ".join(f"ranks {rs}: {v}" for v, rs in groups.items())
            raise ShardMismatchError(
                f"{estimator}: the ranks' shards differ in {label} ({listing}); every rank must pass rows of the "
                "same columns and dtype (cast with X.astype(...) before fit)"
            )
    if not allow_all_empty and sum(t[0] for t in table) == 0:
        raise ValueError(f"{estimator}: every rank passed an empty shard (0 samples in total); at least 1 is required")
    return [t[0] for t in table]
