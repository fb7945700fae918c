"""The data-science workloads of `hpdl bench dask`, each run on a client of either cluster (tcp:// or mpi://).

Every workload builds its data on the workers (seeded, so both clusters hold the same rows) and returns a small
*check* that must be equal on both transports: integer sums where the order of a shuffle could change a float sum,
K-Means' inertia to 1e-9.

    groupby   p2p-shuffled groupby-aggregate of `rows` rows (int64 key with rows/10 groups, two int64 values):
              sum, count and max per key, `split_out` = partitions (the groups travel between the workers);
    merge     p2p hash join of two frames of `rows` rows each (the right one's keys unique), every left row matched;
    tasks     `tasks` dask.delayed calls that each sleep `task_ms` (scheduler-bound: one message out and back each);
    kmeans    hpdl.ml.KMeans (8 clusters, random init, `iterations` Lloyd iterations) on a Dask array of `points` x 16.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = ["WORKLOADS", "Sizes", "run"]

PARTITION_ROWS = 1_000_000
"""Rows per partition (the last may be shorter)."""


@dataclass(frozen=True)
class Sizes:
    rows: int = 10_000_000
    tasks: int = 10_000
    task_ms: float = 1.0
    points: int = 1_000_000
    iterations: int = 20
    """K-Means' Lloyd iterations (tol 0: exactly this many)."""


def _partitions(rows: int) -> list[tuple[int, int]]:
    """(seed, rows) of each partition."""
    starts = range(0, rows, PARTITION_ROWS)
    return [(i, min(PARTITION_ROWS, rows - start)) for i, start in enumerate(starts)]


def _facts(part: tuple[int, int], groups: int) -> Any:
    import pandas as pd

    seed, n = part
    rng = np.random.default_rng(1000 + seed)
    return pd.DataFrame(
        {
            "key": rng.integers(0, groups, n, dtype=np.int64),
            "x": rng.integers(0, 1000, n, dtype=np.int64),
            "y": rng.integers(-500, 500, n, dtype=np.int64),
        }
    )


def _dimension(part: tuple[int, int], start: int, rows: int) -> Any:
    """The right side of the merge: keys start .. start+n of a fixed permutation of range(rows) (each key once)."""
    import pandas as pd

    _, n = part
    keys = (np.arange(start, start + n, dtype=np.int64) * 7_919) % rows  # 7919 is prime: a permutation of range(rows)
    return pd.DataFrame({"key": keys, "z": (keys * 3) % 1001})


def _frame(rows: int, groups: int) -> Any:
    import dask.dataframe as dd

    return dd.from_map(_facts, _partitions(rows), groups=groups)


def groupby(client: Any, sizes: Sizes) -> Any:
    ddf = _frame(sizes.rows, max(1, sizes.rows // 10))
    parts = ddf.npartitions
    out = ddf.groupby("key").agg({"x": ["sum", "count"], "y": "max"}, split_out=parts, shuffle_method="p2p")
    out.columns = ["x_sum", "x_count", "y_max"]
    totals = out.reset_index().assign(weighted=lambda d: d["key"] * d["x_count"], groups=1).sum()
    return {str(k): int(v) for k, v in client.compute(totals).result().items()}


def merge(client: Any, sizes: Sizes) -> Any:
    import dask.dataframe as dd

    left = _frame(sizes.rows, sizes.rows)
    parts = _partitions(sizes.rows)
    starts = [sum(n for _, n in parts[:i]) for i in range(len(parts))]
    right = dd.from_map(_dimension, parts, starts, rows=sizes.rows)
    joined = left.merge(right, on="key", how="inner", shuffle_method="p2p")
    totals = joined.assign(xz=lambda d: d["x"] * d["z"], rows=1).sum()
    return {str(k): int(v) for k, v in client.compute(totals).result().items()}


def _sleep_task(i: int, seconds: float) -> int:
    time.sleep(seconds)
    return i


def tasks(client: Any, sizes: Sizes) -> Any:
    import dask

    calls = [dask.delayed(_sleep_task, pure=False)(i, sizes.task_ms / 1e3) for i in range(sizes.tasks)]
    done = client.gather(client.compute(calls))
    return {"tasks": len(done), "sum": int(sum(done))}


def kmeans(client: Any, sizes: Sizes) -> Any:
    import dask.array as da

    from hpdl.ml import KMeans

    X = da.random.RandomState(0).random_sample((sizes.points, 16), chunks=(max(1, sizes.points // 8), 16))
    with client.as_current():
        model = KMeans(n_clusters=8, init="random", n_init=1, max_iter=sizes.iterations, tol=0.0, random_state=0)
        model.fit(X)
    return {"inertia": float(model.inertia_), "iterations": int(model.n_iter_)}


WORKLOADS: dict[str, Callable[[Any, Sizes], Any]] = {
    "groupby": groupby,
    "merge": merge,
    "tasks": tasks,
    "kmeans": kmeans,
}


def same(a: Any, b: Any) -> bool:
    """Equal checks: integers exactly, floats to 1e-9 (K-Means' inertia sums blocks on the client in one order)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) or isinstance(b, float):
        return bool(abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0))
    return bool(a == b)


def run(name: str, client: Any, sizes: Sizes) -> tuple[float, Any]:
    """(seconds, check) of one run of workload `name` on `client`'s cluster."""
    start = time.perf_counter()
    check = WORKLOADS[name](client, sizes)
    return time.perf_counter() - start, check
