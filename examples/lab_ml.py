"""Lab: cluster and regress real data on MPI ranks and on Dask with hpdl.ml, and check it against scikit-learn.

    hpdl launch -n 2 examples/lab_ml.py            # 2 ranks; rank 0 also runs the Dask part
    python examples/lab_ml.py                      # one process works too

1. K-Means on scikit-learn's handwritten digits (1797 x 64): every rank holds
   an uneven shard, fits `KMeans(comm=comm)`, and gets the same centres as
   scikit-learn on all the data from the same initial centres.
2. Linear regression on the diabetes data: the same coefficients as
   scikit-learn, from one allreduce of X^T X and X^T y.
3. The same two fits on a Dask array (a LocalCluster with 2 workers), on rank 0.
4. A plot: the digits in 2-D (PCA) coloured by cluster, and predicted vs
   measured disease progression.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import sklearn.cluster
import sklearn.linear_model
from sklearn.datasets import load_diabetes, load_digits

import hpdl
from hpdl.ml import KMeans, LinearRegression


def shard(n: int, rank: int, size: int) -> slice:
    """Uneven contiguous shards: rank r holds a share proportional to r + 1."""
    edges = np.round(np.cumsum([0] + [r + 1 for r in range(size)]) / (size * (size + 1) / 2) * n).astype(int)
    return slice(int(edges[rank]), int(edges[rank + 1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench-results/ml/lab_ml.png", help="where to save the plot")
    args = parser.parse_args()
    comm = hpdl.init()
    say = print if comm.rank == 0 else (lambda *a, **k: None)

    # 1. K-Means on the digits, each rank with its own rows
    digits = load_digits()
    X = digits.data
    mine = shard(len(X), comm.rank, comm.size)
    start = X[np.arange(10) * 150]  # the same 10 initial centres for everyone
    km = KMeans(10, init=start, n_init=1, comm=comm).fit(X[mine])
    sk = sklearn.cluster.KMeans(10, init=start, n_init=1).fit(X)
    same = np.allclose(km.cluster_centers_, sk.cluster_centers_, rtol=1e-9) and np.isclose(
        km.inertia_, sk.inertia_, rtol=1e-9
    )
    print(
        f"rank {comm.rank}: K-Means on {len(X[mine])} of {len(X)} digits, inertia {km.inertia_:.1f} "
        f"after {km.n_iter_} iterations (same as scikit-learn: {same})",
        flush=True,
    )

    # 2. Linear regression on the diabetes data
    Xd, yd = load_diabetes(return_X_y=True)
    rows = shard(len(Xd), comm.rank, comm.size)
    lin = LinearRegression(comm=comm).fit(Xd[rows], yd[rows])
    ref = sklearn.linear_model.LinearRegression().fit(Xd, yd)
    r2 = lin.score(Xd[rows], yd[rows])  # R^2 over every rank's rows
    print(
        f"rank {comm.rank}: LinearRegression R^2 {r2:.4f} on all ranks' rows "
        f"(same as scikit-learn: {np.allclose(lin.coef_, ref.coef_, rtol=1e-8)})",
        flush=True,
    )

    # 3. The same on Dask, from rank 0
    if comm.rank == 0:
        import dask.array as da
        from distributed import Client, LocalCluster

        with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster:
            with Client(cluster):
                dX = da.from_array(X, chunks=(500, 64))
                dkm = KMeans(10, init=start, n_init=1).fit(dX)
                dlin = LinearRegression().fit(da.from_array(Xd, chunks=(150, 10)), da.from_array(yd, chunks=150))
                labels = dkm.labels_.compute()
        same_dask = np.allclose(dkm.cluster_centers_, km.cluster_centers_, rtol=1e-9) and np.allclose(
            dlin.coef_, lin.coef_, rtol=1e-8
        )
        say(
            f"Dask (2 workers): K-Means inertia {dkm.inertia_:.1f}, regression R^2 "
            f"{dlin.score(Xd, yd):.4f} (same as on the ranks: {same_dask})"
        )
        plot(args.out, X, labels, dkm, yd, dlin.predict(Xd))
        say(f"plot saved to {args.out}")
    comm.barrier()
    hpdl.finalize()


def plot(path: str, X: np.ndarray, labels: np.ndarray, km: KMeans, y: np.ndarray, pred: np.ndarray) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from sklearn.decomposition import PCA

    pca = PCA(2).fit(X)
    flat, centres = pca.transform(X), pca.transform(km.cluster_centers_)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.scatter(flat[:, 0], flat[:, 1], c=labels, cmap="tab10", s=6)
    left.scatter(centres[:, 0], centres[:, 1], c="black", marker="x", s=60)
    left.set_title("digits, K-Means (k=10) on Dask, PCA view")
    right.scatter(y, pred, s=8)
    right.plot([y.min(), y.max()], [y.min(), y.max()], color="grey", linewidth=1)
    right.set_xlabel("measured progression")
    right.set_ylabel("predicted")
    right.set_title("diabetes, LinearRegression")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
