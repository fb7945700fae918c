"""A lab: the same Dask work on the same MPI ranks, over tcp:// and then over hpdl's mpi:// transport.

    hpdl launch -n 4 examples/lab_dask.py [--size 4000 --chunk 500] [--json results.json] [--dask-log]

Rank 0 runs the scheduler, rank 1 this script's client code, ranks 2.. the
workers (`hpdl.dask.run_cluster`, collective). Each workload runs once per
transport (after a small warm-up of each) and once in this
process alone (Dask's synchronous scheduler or plain pandas/NumPy); the lab
checks that all three agree and prints the wall times side by side. One run on a busy machine is an illustration, not a
benchmark: `hpdl bench dask` measures with repetitions.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from hpdl.dask import run_cluster


def transpose_sum(client: Any, n: int, chunk: int) -> float:
    """sum(x + x.T): every output chunk needs a chunk from the mirror position, so data moves between workers."""
    import dask.array as da

    x = da.random.RandomState(0).random_sample((n, n), chunks=chunk)
    scheduler = None if client is not None else "sync"
    return float((x + x.T).sum().compute(scheduler=scheduler))


def diabetes_frames() -> tuple[Any, Any]:
    """scikit-learn's bundled diabetes data (442 patients), and per-age-band notes to merge with."""
    import pandas as pd
    from sklearn.datasets import load_diabetes

    df = load_diabetes(as_frame=True, scaled=False).frame
    df["band"] = (df["age"] // 10).astype(int)
    notes = pd.DataFrame({"band": range(1, 10), "weight": np.linspace(0.5, 1.5, 9)})
    return df, notes


def groupby_merge(client: Any) -> dict[str, Any]:
    """A shuffle-heavy groupby, then a merge back onto every row; the same answer as pandas on one process."""
    import dask.dataframe as dd

    df, notes = diabetes_frames()
    if client is None:  # the one-process reference: plain pandas
        stats = df.groupby("band").agg(bmi=("bmi", "mean"), target=("target", "sum"), n=("target", "size"))
        merged = df.merge(stats.reset_index(), on="band", suffixes=("", "_band")).merge(notes, on="band")
    else:
        ddf = dd.from_pandas(df, npartitions=6)
        stats = ddf.groupby("band").agg(bmi=("bmi", "mean"), target=("target", "sum"), n=("target", "size"))
        merged = ddf.merge(stats.reset_index(), on="band", suffixes=("", "_band")).merge(notes, on="band")
        stats, merged = stats.compute(), merged.compute()
    merged = merged.sort_values(["band", "s1", "s2", "bmi"]).reset_index(drop=True)
    return {
        "groupby": {int(k): [float(v) for v in row] for k, row in stats.sort_index().iterrows()},
        "merged_rows": len(merged),
        "merged_checksum": float((merged["target"] * merged["weight"] + merged["bmi_band"]).sum()),
    }


def kmeans(client: Any, max_iter: int = 30) -> dict[str, Any]:
    """hpdl.ml's K-Means on a Dask array of scikit-learn's digits (runs on the workers of the client)."""
    import dask.array as da
    from sklearn.datasets import load_digits

    from hpdl.ml import KMeans

    X = load_digits().data.astype(np.float64)
    data: Any = da.from_array(X, chunks=450) if client is not None else X
    model = KMeans(n_clusters=10, init="random", n_init=1, max_iter=max_iter, random_state=0).fit(data)
    centers = np.asarray(model.cluster_centers_)
    order = np.lexsort(np.round(centers, 6).T[::-1])  # a canonical order (labels are arbitrary)
    return {"inertia": float(model.inertia_), "centers": centers[order].tolist()}


def _import_libraries() -> None:
    import dask.array  # noqa: F401
    import dask.dataframe  # noqa: F401
    import sklearn.datasets  # noqa: F401

    import hpdl.ml  # noqa: F401


def workloads(client: Any, n: int, chunk: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if client is not None:  # warm up: a process's first Dask work (imports, caches) is not the transport's time
        client.run(_import_libraries)
        transpose_sum(client, 2 * chunk, chunk)
        groupby_merge(client)
        kmeans(client, max_iter=2)
    for name, fn in (
        ("transpose_sum", lambda: transpose_sum(client, n, chunk)),
        ("groupby_merge", lambda: groupby_merge(client)),
        ("kmeans", lambda: kmeans(client)),
    ):
        start = time.perf_counter()
        out[name] = fn()
        out[f"{name}_seconds"] = time.perf_counter() - start
    if client is not None:
        out["workers"] = sorted(client.scheduler_info()["workers"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2000, help="x is size x size (default 2000)")
    parser.add_argument("--chunk", type=int, default=500, help="chunk edge (default 500)")
    parser.add_argument("--json", help="write every result here (rank 1)")
    parser.add_argument("--dask-log", action="store_true", help="show Dask's INFO log (every connection)")
    args = parser.parse_args()
    if not args.dask_log:
        _quiet_dask()

    results = {}
    for protocol in ("tcp", "mpi"):
        results[protocol] = run_cluster(lambda client: workloads(client, args.size, args.chunk), protocol=protocol)
    if results["tcp"] is None:  # not rank 1: scheduler and workers have done their part
        return
    results["one process"] = workloads(None, args.size, args.chunk)

    print(f"\n{'workload':<16}{'tcp:// s':>10}{'mpi:// s':>10}{'1 proc s':>10}  same result")
    for name in ("transpose_sum", "groupby_merge", "kmeans"):
        a, b, ref = (results[k][name] for k in ("tcp", "mpi", "one process"))
        same = _close(a, b) and _close(a, ref)
        times = [results[k][f"{name}_seconds"] for k in ("tcp", "mpi", "one process")]
        print(f"{name:<16}" + "".join(f"{t:>10.2f}" for t in times) + f"  {same}")
        if not same:
            print(f"lab_dask: {name} differs between the transports or from one process: {a} {b} {ref}", flush=True)
            raise SystemExit(1)
    print(f"workers over mpi://: {results['mpi']['workers']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle)


def _quiet_dask() -> None:
    """Dask logs every connection at INFO, and each cluster's shutdown with tracebacks at INFO too
    ("Batched Comm Closed"): about 150 lines before the table. Warnings and errors still show."""
    import logging

    import distributed  # noqa: F401 - importing it sets its loggers' levels: set ours after

    logging.getLogger("distributed").setLevel(logging.WARNING)


def _close(a: Any, b: Any) -> bool:
    """Equal up to floating-point summation order (relative 1e-9)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return bool(np.isclose(a, b, rtol=1e-9, atol=1e-9))
    return bool(a == b)


if __name__ == "__main__":
    main()
