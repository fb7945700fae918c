"""`python -m hpdl.ml.jit_cache`: compile every numba loop of hpdl.ml into numba's on-disk cache, once.

`make install` runs it. Without it, the ranks that a fresh checkout's first jobs start together each compile the
loops for themselves (about 9 CPU-seconds apiece) before any of them has written the cache.
"""

from __future__ import annotations

import numpy as np

from hpdl.ml import kernels
from hpdl.ml.kmeans import KMeans

__all__ = ["main"]


def main() -> None:
    kernels.warm_up()
    for dtype in (np.float32, np.float64):  # a fit's later iterations run the Hamerly-bound loops
        points = np.random.default_rng(0).normal(size=(64, 2)).astype(dtype)
        for weights in (None, np.linspace(0.5, 1.5, 64)):
            KMeans(3, n_init=1, max_iter=4, tol=0.0, random_state=0).fit(points, sample_weight=weights)


if __name__ == "__main__":
    main()
