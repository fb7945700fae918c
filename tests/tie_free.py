"""Data for comparisons across libraries that no CPU's rounding can flip.

hpdl and scikit-learn compute the same distances with different BLAS kernels
(torch/MKL, numba, OpenBLAS per CPU: AVX-512, AVX2, Sandybridge), which
differ in the last bits. On data with exact ties (integer pixels, iris's
one-decimal measurements, duplicate rows) those bits decide which centre a
point joins or which k-means++ candidate wins, and the two libraries then
follow different, equally valid paths. Parity tests therefore run on data
moved off its ties by a small continuous jitter, and check the margin that
makes the result independent of rounding; what must hold on tied data is
tested as properties (tests/test_ml_local.py::test_kmeans_on_tied_data_*).
"""

from __future__ import annotations

import numpy as np

__all__ = ["assignment_margin", "jittered"]

ROUNDING_MARGIN = 1e-7
"""A relative gap between the nearest and second-nearest centre that rounding (~1e-15) cannot close."""


def jittered(X: np.ndarray, seed: int = 0, scale: float = 1e-3) -> np.ndarray:
    """X plus uniform noise of `scale` times each feature's spread: no two distances tie exactly any more."""
    rng = np.random.default_rng(seed)
    spread = np.where(X.std(axis=0) > 0, X.std(axis=0), 1.0)
    return (X + rng.uniform(-scale, scale, X.shape) * spread).astype(X.dtype)


def assignment_margin(X: np.ndarray, centres: np.ndarray) -> float:
    """The smallest gap, over points, between the squared distances to the nearest two centres, relative."""
    d = ((X[:, None, :].astype(np.float64) - centres[None, :, :]) ** 2).sum(axis=2)
    d.sort(axis=1)
    return float(((d[:, 1] - d[:, 0]) / np.maximum(d[:, 1], 1e-300)).min())
