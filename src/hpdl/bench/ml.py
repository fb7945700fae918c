"""`hpdl bench ml`: hpdl.ml on MPI ranks and on Dask beside dask-ml and scikit-learn, 2 cores for everyone.

Contenders, per task, on the same data (generated block by block from fixed
seeds, so every process makes the rows it needs) and the same options:

    hpdl-mpi     hpdl.ml with comm= on 2 MPI ranks (1 thread each; one mpiexec per round)
    hpdl-dask    hpdl.ml on a Dask array, LocalCluster of 2 worker processes x 1 thread
    dask-ml      dask-ml's estimator on the same cluster (an error is reported as its result)
    sklearn      scikit-learn in this process with 2 threads (threadpoolctl)

Rounds alternate the contenders (A B C D A B C D ...). Tasks: K-Means
(float32, 16 clusters, the same 16 initial centres for all, overlapping
clusters and tol=0 so every run does all max_iter iterations; time per
iteration and inertia recomputed from each contender's centres),
LinearRegression (float64; R^2), k-NN (k=10; recall against exact
neighbours). The fit time includes everything a user waits for after the
data is in memory (centring, norms, iterations); data generation is excluded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np

from hpdl.bench import report
from hpdl.bench.arguments import positive as _positive

__all__ = ["launch", "main", "CONTENDERS", "TASKS"]

CONTENDERS = ("hpdl-mpi", "hpdl-dask", "dask-ml", "sklearn")
TASKS = ("kmeans", "linear", "knn", "logistic", "pca")
BLOCK = 65536
"""Rows per generated block (each from its own seed)."""
TARGETS = {
    "kmeans": ("dask-ml", 8.0),
    "linear": ("sklearn", 1.0),
    "knn": ("sklearn", 1.2),
    "logistic": ("sklearn", 1.0),
    "pca": ("sklearn", 1.0),
}
SECOND_TARGETS = {"kmeans": ("sklearn", 1.2), "logistic": ("dask-ml", 3.0), "pca": ("dask-ml", 3.0)}
"""Issue #21's targets: K-Means per iteration (time per iteration, same iteration count for all)."""
SUPERVISED = ("linear", "logistic")


@dataclass(frozen=True)
class Options:
    quick: bool = False
    out: str = "bench-results/ml"
    tasks: tuple[str, ...] = TASKS
    contenders: tuple[str, ...] = CONTENDERS
    rounds: int = 3
    km_rows: int = 1_000_000
    km_features: int = 32
    km_clusters: int = 16
    km_iter: int = 50
    lin_rows: int = 2_000_000
    lin_features: int = 64
    knn_index: int = 100_000
    knn_queries: int = 10_000
    knn_features: int = 32
    knn_k: int = 10
    log_rows: int = 500_000
    log_features: int = 32
    log_c: float = 1.0
    log_iter: int = 100
    pca_rows: int = 500_000
    pca_features: int = 64
    pca_components: int = 10
    dask_chunk: int = 125_000
    timeout: float = 1800.0


def parse(argv: Sequence[str]) -> Options:
    parser = argparse.ArgumentParser(
        prog="hpdl bench ml",
        description="hpdl.ml (2 MPI ranks; 2 Dask workers) beside dask-ml and scikit-learn (2 threads): "
        "K-Means, LinearRegression, k-NN; times, ratios and quality side by side.",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, 1 round (a smoke test, seconds)")
    parser.add_argument("--out", default="bench-results/ml", help="output folder (default bench-results/ml)")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, help="tasks (default: all)")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, help="contenders (default: all)")
    parser.add_argument("--rounds", type=_positive(int), help="timed rounds per contender (default 3)")
    parser.add_argument("--timeout", type=_positive(float), default=1800.0, help="limit per MPI launch in s")
    ns = parser.parse_args(list(argv))
    quick = bool(ns.quick)
    sizes: dict[str, Any] = {}
    if quick:
        sizes = dict(km_rows=20_000, km_iter=10, lin_rows=20_000, lin_features=16, knn_index=5_000, knn_queries=500)
        sizes.update(log_rows=20_000, pca_rows=20_000)
        sizes["dask_chunk"] = 5_000
    return Options(
        quick=quick,
        out=ns.out,
        tasks=tuple(ns.tasks or TASKS),
        contenders=tuple(ns.contenders or CONTENDERS),
        rounds=ns.rounds or (1 if quick else 3),
        timeout=ns.timeout,
        **sizes,
    )


# --------------------------------------------------------------------------- data (any row range, any process)
def _rows(task: str, opts: dict, lo: int, hi: int, part: str = "X") -> Any:
    """Rows lo:hi of a task's data, generated per BLOCK from its own seed (identical in every process)."""
    pieces = []
    for b in range(lo // BLOCK, (hi - 1) // BLOCK + 1 if hi > lo else lo // BLOCK):
        pieces.append(_block(task, opts, b, part))
    if not pieces:
        return _block(task, opts, 0, part)[:0]
    whole = np.concatenate(pieces)
    start = lo - (lo // BLOCK) * BLOCK
    return np.ascontiguousarray(whole[start : start + hi - lo])


def _block(task: str, o: dict, b: int, part: str) -> Any:
    rng = np.random.default_rng([7, TASKS.index(task), b, 0 if part in ("X", "y") else 1])
    if task == "kmeans":
        centres = np.random.default_rng(11).normal(size=(o["km_clusters"], o["km_features"]))
        labels = rng.integers(0, o["km_clusters"], BLOCK)
        return (centres[labels] + 2.0 * rng.normal(size=(BLOCK, o["km_features"]))).astype(np.float32)
    if task == "linear":
        beta = np.random.default_rng(12).normal(size=o["lin_features"])
        X = rng.normal(size=(BLOCK, o["lin_features"]))
        if part == "X":
            return X
        return X @ beta + 3.0 + 0.5 * rng.normal(size=BLOCK)
    if task == "logistic":
        beta = np.random.default_rng(13).normal(size=o["log_features"]) / np.sqrt(o["log_features"])
        X = rng.normal(size=(BLOCK, o["log_features"]))
        if part == "X":
            return X
        return (X @ beta + 0.5 * rng.logistic(size=BLOCK) > 0.2).astype(np.int64)
    if task == "pca":  # correlated columns with a spread of variances, and an offset (a mean to remove)
        mix = np.random.default_rng(14).normal(size=(o["pca_features"], o["pca_features"]))
        mix *= np.geomspace(3.0, 0.05, o["pca_features"])[:, None]
        return rng.normal(size=(BLOCK, o["pca_features"])) @ mix + 1.0
    return rng.normal(size=(BLOCK, o["knn_features"])).astype(np.float32)


def _sizes(task: str, o: dict) -> int:
    return {
        "kmeans": o["km_rows"],
        "linear": o["lin_rows"],
        "knn": o["knn_index"],
        "logistic": o["log_rows"],
        "pca": o["pca_rows"],
    }[task]


def _dask_rows(task: str, o: dict, part: str = "X") -> Any:
    import dask
    import dask.array as da

    n, chunk = _sizes(task, o), o["dask_chunk"]
    pieces = []
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        sample = _rows(task, o, 0, 1, part)
        shape = (hi - lo, *sample.shape[1:])
        pieces.append(da.from_delayed(dask.delayed(_rows)(task, o, lo, hi, part), shape=shape, dtype=sample.dtype))
    return da.concatenate(pieces).persist()


def _queries(o: dict) -> Any:
    rng = np.random.default_rng(99)
    return rng.normal(size=(o["knn_queries"], o["knn_features"])).astype(np.float32)


# --------------------------------------------------------------------------- contenders
def _fit_task(task: str, o: dict, X: Any, y: Any, lib: str, comm: Any = None) -> tuple[float, dict]:
    """Fit (and for k-NN, query) once; return (seconds, result fields)."""
    init = _rows("kmeans", o, 0, o["km_clusters"]) if task == "kmeans" else None
    if lib == "hpdl":
        import hpdl.ml as ml

        model: Any
        if task == "kmeans":
            model = ml.KMeans(o["km_clusters"], init=init, n_init=1, max_iter=o["km_iter"], tol=0.0, comm=comm)
        elif task == "linear":
            model = ml.LinearRegression(comm=comm)
        elif task == "logistic":
            model = ml.LogisticRegression(C=o["log_c"], max_iter=o["log_iter"], comm=comm)
        elif task == "pca":
            model = ml.PCA(o["pca_components"], comm=comm)
        else:
            model = ml.NearestNeighbors(n_neighbors=o["knn_k"], comm=comm)
    elif lib == "sklearn":
        import sklearn.cluster
        import sklearn.decomposition
        import sklearn.linear_model
        import sklearn.neighbors

        if task == "kmeans":
            model = sklearn.cluster.KMeans(o["km_clusters"], init=init, n_init=1, max_iter=o["km_iter"], tol=0.0)
        elif task == "linear":
            model = sklearn.linear_model.LinearRegression()
        elif task == "logistic":
            model = sklearn.linear_model.LogisticRegression(C=o["log_c"], max_iter=o["log_iter"])
        elif task == "pca":
            model = sklearn.decomposition.PCA(o["pca_components"], svd_solver="covariance_eigh")
        else:
            model = sklearn.neighbors.NearestNeighbors(n_neighbors=o["knn_k"], algorithm="brute")
    else:
        if task == "kmeans":
            import dask_ml.cluster

            model = dask_ml.cluster.KMeans(
                n_clusters=o["km_clusters"], init=init, max_iter=o["km_iter"], tol=0.0, random_state=0
            )
        elif task == "linear":
            import dask_ml.linear_model

            model = dask_ml.linear_model.LinearRegression(solver="lbfgs", max_iter=100)
        elif task == "logistic":
            import dask_ml.linear_model

            model = dask_ml.linear_model.LogisticRegression(solver="lbfgs", C=o["log_c"], max_iter=o["log_iter"])
        elif task == "pca":
            import dask_ml.decomposition

            model = dask_ml.decomposition.PCA(o["pca_components"], svd_solver="full")
        else:
            raise NotImplementedError("dask-ml has no nearest-neighbours estimator")
    if comm is not None:
        comm.barrier()
    start = time.perf_counter()
    fields: dict[str, Any] = {}
    if task == "knn":
        model.fit(X)
        queries = _queries(o)
        if comm is not None:  # each rank asks for its half of the queries
            half = np.array_split(np.arange(len(queries)), comm.size)[comm.rank]
            queries = queries[half]
        _, idx = model.kneighbors(queries)
        fields["indices"] = idx
    elif task in SUPERVISED:
        model.fit(X, y)
    else:
        model.fit(X)
    if comm is not None:
        comm.barrier()
    seconds = time.perf_counter() - start
    if task == "kmeans":
        fields.update(centres=np.asarray(model.cluster_centers_), n_iter=int(np.max(model.n_iter_)))
        fields["own_inertia"] = float(model.inertia_)
    elif task in SUPERVISED:
        fields.update(coef=np.ravel(model.coef_), intercept=float(np.ravel(model.intercept_)[0]))
    elif task == "pca":
        fields.update(variance=np.asarray(model.explained_variance_, dtype=np.float64))
    return seconds, fields


def mpi_worker(spec_path: str) -> int:
    """One round of one task on the MPI ranks (`python -m hpdl.bench.ml --mpi-worker spec.json`)."""
    import hpdl

    with open(spec_path) as handle:
        spec = json.load(handle)
    task, o = spec["task"], spec["options"]
    from hpdl.ml import bounds, kernels

    comm = hpdl.init("mpi", timeout=600.0)
    kernels.warm_up()  # JIT compilation (or numba's cache) is set-up, as the imports are
    bounds.warm_up()
    n = _sizes(task, o)
    lo, hi = [(int(a[0]), int(a[-1]) + 1) for a in np.array_split(np.arange(n), comm.size)][comm.rank]
    X = _rows(task, o, lo, hi)
    y = _rows(task, o, lo, hi, "y") if task in SUPERVISED else None
    seconds, fields = _fit_task(task, o, X, y, "hpdl", comm)
    if task == "knn":
        parts = comm.allgather(np.ascontiguousarray(fields["indices"]))
        fields["indices"] = parts
    if comm.rank == 0:
        arrays: dict[str, Any] = {k: np.asarray(v) for k, v in fields.items()}
        np.savez(str(spec["result"]), seconds=seconds, **arrays)
    comm.barrier()
    hpdl.finalize()
    return 0


def _run_mpi(task: str, o: dict, ranks: int, timeout: float) -> tuple[float, dict]:
    from hpdl.runtime import spawn

    with tempfile.TemporaryDirectory() as tmp:
        spec = {"task": task, "options": o, "result": os.path.join(tmp, "result.npz")}
        path = os.path.join(tmp, "spec.json")
        with open(path, "w") as handle:
            json.dump(spec, handle)
        env = spawn.job_environment("mpi", ranks)
        env["OMP_NUM_THREADS"] = "1"
        code = spawn.run(ranks, ["-m", "hpdl.bench.ml", "--mpi-worker", path], env=env, timeout=timeout, name="ml")
        if code != 0:
            raise RuntimeError(f"the MPI run exited with code {code}")
        data = np.load(os.path.join(tmp, "result.npz"))
        return float(data["seconds"]), {k: data[k] for k in data.files if k != "seconds"}


# --------------------------------------------------------------------------- quality and report
def _quality(task: str, o: dict, fields: dict, reference: dict) -> dict:
    if task == "kmeans":
        import hpdl.ml as ml

        model = ml.KMeans(o["km_clusters"])
        model.cluster_centers_ = np.asarray(fields["centres"], dtype=np.float32)
        model.n_features_in_ = o["km_features"]
        inertia = -model.score(reference["X"])
        return {"inertia": inertia, "own_inertia": float(fields["own_inertia"]), "n_iter": int(fields["n_iter"])}
    if task == "logistic":
        X, y = reference["X"], reference["y"]
        pred = (X @ np.asarray(fields["coef"]) + float(fields["intercept"]) > 0).astype(np.int64)
        diff = float(np.abs(fields["coef"] - reference["coef"]).max())
        return {"accuracy": float((pred == y).mean()), "max_coef_diff_vs_sklearn": diff}
    if task == "pca":
        ev = np.asarray(fields["variance"])
        rel = float(np.max(np.abs(ev / reference["variance"] - 1)))
        return {"explained_variance": float(ev.sum()), "max_rel_variance_diff_vs_sklearn": rel}
    if task == "linear":
        X, y = reference["X"], reference["y"]
        pred = X @ np.asarray(fields["coef"]) + float(fields["intercept"])
        r2 = 1 - float(((y - pred) ** 2).sum()) / float(((y - y.mean()) ** 2).sum())
        return {"r2": r2, "max_coef_diff_vs_sklearn": float(np.abs(fields["coef"] - reference["coef"]).max())}
    got = fields["indices"]
    got = np.concatenate(list(got)) if isinstance(got, (list, tuple)) or got.ndim == 3 else got
    exact = reference["indices"]
    hits = [len(np.intersect1d(a, b)) for a, b in zip(got, exact)]
    return {"recall": float(np.sum(hits)) / exact.size}


def _measure(task: str, options: Options) -> list[dict[str, Any]]:
    """Every contender on one task, alternating per round; the Dask contenders on a cluster of their own per run."""
    from threadpoolctl import threadpool_limits

    o = asdict(options)
    n = _sizes(task, o)
    X = _rows(task, o, 0, n)
    y = _rows(task, o, 0, n, "y") if task in SUPERVISED else None
    reference: dict[str, Any] = {"X": X, "y": y}

    def sk() -> tuple[float, dict]:
        with threadpool_limits(2):
            return _fit_task(task, o, X, y, "sklearn")

    def on_dask(lib: str) -> tuple[float, dict]:
        # A cluster of its own per run: idle Dask workers cost ~7% of a core each, which would slow the others.
        # --quick times nothing worth quoting: its one cluster, made in _run, serves every run.
        with contextlib.nullcontext() if options.quick else _cluster():
            dX = _dask_rows(task, o)
            dy = _dask_rows(task, o, "y") if task in SUPERVISED else None
            return _fit_task(task, o, dX, dy, lib)

    runs: dict[str, Callable[[], tuple[float, dict]]] = {
        "hpdl-mpi": lambda: _run_mpi(task, o, 2, options.timeout),
        "hpdl-dask": lambda: on_dask("hpdl"),
        "dask-ml": lambda: on_dask("dask-ml"),
        "sklearn": sk,
    }
    times: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    last: dict[str, Any] = {}
    for _ in range(options.rounds):
        for name in options.contenders:
            if isinstance(last.get(name), Exception):
                continue
            try:
                seconds, fields = runs[name]()
            except Exception as exc:  # a peer's failure is its result, shown in the table
                last[name] = exc
                continue
            times[name].append(seconds)
            last[name] = fields
    if not isinstance(last.get("sklearn"), dict):  # not a contender (or it failed): the quality reference, untimed
        last_sklearn = sk()[1]
    else:
        last_sklearn = last["sklearn"]
    if task in SUPERVISED:
        reference["coef"] = last_sklearn["coef"]
    if task == "pca":
        reference["variance"] = last_sklearn["variance"]
    if task == "knn":
        reference["indices"] = last_sklearn["indices"]
    records = []
    for name in options.contenders:
        rec: dict[str, Any] = {"task": task, "contender": name, "rows": n}
        result = last.get(name)
        if isinstance(result, Exception) or result is None:
            rec["error"] = f"{type(result).__name__}: {str(result).splitlines()[0][:160] if str(result) else ''}"
        else:
            rec["seconds"] = report.summarize(times[name])
            rec.update(_quality(task, o, result, reference))
            if task == "kmeans":
                rec["ms_per_iter"] = rec["seconds"]["median"] / max(1, rec["n_iter"]) * 1e3
        records.append(rec)
    return records


def _warm_worker() -> None:
    import importlib

    for name in ("torch", "sklearn.cluster", "sklearn.linear_model", "hpdl.ml", "dask_ml.cluster"):
        try:
            importlib.import_module(name)
        except ImportError:  # dask-ml's own import error is reported when its estimator runs
            pass
    from hpdl.ml import bounds, kernels

    kernels.warm_up()
    bounds.warm_up()


@contextlib.contextmanager
def _cluster() -> Iterator[Any]:
    """A 2-worker LocalCluster (1 thread each) with its imports done, as the current Client."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with Client(cluster) as client:
            client.run(_warm_worker)  # imports (torch, scikit-learn, dask-ml) are set-up, not fit time
            yield client


def _run(options: Options) -> list[dict[str, Any]]:
    os.environ["OMP_NUM_THREADS"] = "1"  # the Dask worker processes inherit it: 1 thread each
    records: list[dict[str, Any]] = []
    on_dask = any(name in ("hpdl-dask", "dask-ml") for name in options.contenders)
    with _cluster() if options.quick and on_dask else contextlib.nullcontext():
        for task in options.tasks:
            records += _measure(task, options)
    return records


HEADERS = ["task", "contender", "fit s (median)", "min-max", "ms/iter", "vs sklearn", "vs dask-ml", "quality", "note"]


def _table(records: list[dict[str, Any]]) -> tuple[str, list[str]]:
    rows, verdicts = [], []
    for task in dict.fromkeys(r["task"] for r in records):
        mine = {r["contender"]: r for r in records if r["task"] == task}

        def median(name: str, mine: dict = mine) -> Optional[float]:
            r = mine.get(name, {})
            return r["seconds"]["median"] if "seconds" in r else None

        for name, r in mine.items():
            t = median(name)
            if t is None:
                rows.append([task, name, None, None, None, None, None, None, r.get("error", "")])
                continue
            s, dm = median("sklearn"), median("dask-ml")
            r["vs_sklearn"] = s / t if s else None
            r["vs_dask_ml"] = dm / t if dm else None
            quality = {
                "kmeans": "inertia",
                "linear": "r2",
                "knn": "recall",
                "logistic": "accuracy",
                "pca": "explained_variance",
            }[task]
            note = f"own inertia {r['own_inertia']:.6g}, {r['n_iter']} iters" if task == "kmeans" else ""
            if "max_coef_diff_vs_sklearn" in r:
                note = f"max coef diff vs sklearn {r['max_coef_diff_vs_sklearn']:.2g}"
            if "max_rel_variance_diff_vs_sklearn" in r:
                note = f"explained variance vs sklearn: max rel diff {r['max_rel_variance_diff_vs_sklearn']:.2g}"
            rows.append(
                [
                    task,
                    name,
                    t,
                    f"{r['seconds']['min']:.3g}-{r['seconds']['max']:.3g}",
                    r.get("ms_per_iter"),
                    r["vs_sklearn"],
                    r["vs_dask_ml"],
                    f"{quality} {r[quality]:.6g}",
                    note,
                ]
            )
        hp = mine.get("hpdl-mpi", {})
        for peer, target in [TARGETS[task]] + ([SECOND_TARGETS[task]] if task in SECOND_TARGETS else []):
            ratio = hp.get("vs_sklearn" if peer == "sklearn" else "vs_dask_ml")
            if task == "kmeans" and ratio is not None:  # per iteration: runs may stop after different counts
                theirs = mine.get(peer, {}).get("ms_per_iter")
                ratio = theirs / hp["ms_per_iter"] if theirs and hp.get("ms_per_iter") else ratio
            if ratio is None:
                verdicts.append(f"n/a {task}: no {peer} time to compare")
                continue
            what = "time per iteration" if task == "kmeans" else "speed"
            verdicts.append(
                f"{report.verdict(ratio >= target)} {task}: hpdl-mpi {ratio:.2f}x {peer}'s {what} (target >= {target}x)"
            )
    return report.markdown_table(HEADERS, rows, right_align_from=2), verdicts


def write_report(options: Options, records: list[dict[str, Any]], elapsed: float) -> str:
    config = report.environment(benchmark="ml", **{k: v for k, v in asdict(options).items() if k != "out"})
    table, verdicts = _table(records)
    header = (
        f"hpdl bench ml{' --quick' if options.quick else ''}: {options.rounds} rounds, 2 cores for every contender "
        f"(2 MPI ranks x 1 thread; 2 Dask workers x 1 thread; scikit-learn 2 threads). K-Means "
        f"{options.km_rows}x{options.km_features} float32, k={options.km_clusters}, {options.km_iter} iterations "
        f"(tol=0), same initial centres; LinearRegression {options.lin_rows}x{options.lin_features} float64; "
        f"k-NN {options.knn_index} indexed x {options.knn_queries} queries x {options.knn_features}, "
        f"k={options.knn_k}; LogisticRegression (binary, L2, C={options.log_c}, lbfgs, max_iter={options.log_iter}) "
        f"{options.log_rows}x{options.log_features} float64; PCA ({options.pca_components} components) "
        f"{options.pca_rows}x{options.pca_features} float64."
    )
    notes = [
        "fit s: fit (k-NN: fit + kneighbors) after the data is in memory; vs X = X's time / this time (>1 = faster).",
        "inertia: recomputed by one evaluator from each contender's centres; 'own inertia' is what it reported.",
        "recall: share of the exact 10 neighbours (scikit-learn brute force) found. dask-ml has no k-NN.",
        "dask-ml LinearRegression: solver lbfgs, max_iter=100 (its default penalty); errors are shown as results.",
        "logistic accuracy: on the training rows from each contender's coefficients; PCA: explained variance "
        "(sum over the components) and the largest relative difference from scikit-learn's, per component.",
    ]
    text = report.markdown_document("hpdl bench ml", header, [table], notes, verdicts)
    report.write_report(options.out, "ml", text, records, config, elapsed)
    return text


def launch(argv: list[str]) -> int:
    """`hpdl bench ml [--quick] [--tasks ...]`: run every contender here and write the report."""
    return report.launch_parsed(parse, argv, _run_and_report)


def _run_and_report(options: Options) -> int:
    """Every contender in this process's reach (hpdl-mpi starts its own mpiexec per round), then the report."""
    started = time.perf_counter()
    print(f"hpdl bench ml: tasks {', '.join(options.tasks)}; {options.rounds} round(s) ...", flush=True)
    records = _run(options)
    write_report(options, records, time.perf_counter() - started)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--mpi-worker"]:
        return mpi_worker(args[1])
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
