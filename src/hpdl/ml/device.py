"""Device arrays in and out of hpdl.ml: torch tensors, and CuPy (or any DLPack) arrays through torch, no copy.

cuML's convention: an estimator given a device array computes on that
device and answers with arrays of the same kind (`labels_`, `predict`,
`transform`, `kneighbors`); the fitted parameters (`cluster_centers_`) are
small and stay NumPy. The kernels' torch path does the work on the
tensor's own device; what crosses to the host are the small partial results
that every mode reduces (per-centre sums, candidate neighbours), so the same
estimator also runs on MPI ranks with one GPU each. A tensor on the CPU is
computed through NumPy (a view of the same memory, so the compiled loops and
scikit-learn's own initialisation serve it) and answered with tensors.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

import numpy as np
import torch

from hpdl.ml.base import numpy_dtype

__all__ = ["is_device_array", "stays_on_device", "as_tensor", "validate", "host", "like"]

CPU_TENSORS_ON_TORCH = False
"""True computes CPU tensors on the torch path, the one a GPU array takes (tests flip it: there is no GPU here)."""


def is_device_array(X: Any) -> bool:
    """A torch tensor, or an array that is neither NumPy nor Dask but speaks DLPack (CuPy, JAX, ...)."""
    if isinstance(X, torch.Tensor):
        return True
    if isinstance(X, np.ndarray) or not hasattr(X, "__dlpack__"):
        return False
    return not type(X).__module__.startswith("dask.")


def stays_on_device(X: Any) -> bool:
    """Whether a device array is computed where it lives: on a GPU (or any device but the CPU), not on the CPU."""
    return as_tensor(X).device.type != "cpu" or CPU_TENSORS_ON_TORCH


def as_tensor(X: Any) -> torch.Tensor:
    """A torch view of a device array (the same memory)."""
    return X if isinstance(X, torch.Tensor) else torch.from_dlpack(X)


def validate(X: Any, *, dtype: Sequence[Any], allow_empty: bool, estimator: str, name: str = "X") -> torch.Tensor:
    """scikit-learn's checks of `check_array` on the device: 2-D, numeric, finite; a dtype from `dtype` (else the
    first of them), C-contiguous. Raises what `check_array` raises, with its words."""
    t = as_tensor(X).detach()
    if t.ndim > 2:
        raise ValueError(f"Found array with dim {t.ndim}, while dim <= 2 is required by {estimator}.")
    if t.ndim != 2:
        raise ValueError(
            f"Expected 2D array, got {t.ndim}D array instead. Reshape your data either using array.reshape(-1, 1) if "
            "your data has a single feature or array.reshape(1, -1) if it contains a single sample."
        )
    if t.is_complex():
        raise ValueError("Complex data not supported")
    choices = [numpy_dtype(d) for d in dtype if d is not None] or [np.dtype(np.float64)]
    own = _numpy_name(t.dtype)
    if own is None or own not in choices:  # (NumPy reads None as float64: ask first)
        t = t.to(getattr(torch, choices[0].name))
    rows, features = t.shape
    for count, what in ((rows, "sample"), (features, "feature")):
        if count == 0 and (what == "feature" or not allow_empty):
            raise ValueError(
                f"Found array with 0 {what}(s) (shape=({rows}, {features})) while a minimum of 1 is required by "
                f"{estimator}."
            )
    if t.numel() and not bool(torch.isfinite(t).all()):
        what = "NaN" if bool(torch.isnan(t).any()) else "infinity or a value too large for " + repr(choices[0])
        raise ValueError(f"Input {name} contains {what}.")
    return t.contiguous()


def _numpy_name(dtype: torch.dtype) -> Any:
    """NumPy's dtype of a torch dtype, or None for one torch cannot hand to NumPy (bfloat16, float8), converted
    like any other. Asked of torch itself: with ml_dtypes installed (TensorFlow brings it) NumPy knows a
    "bfloat16" by name, but `Tensor.numpy()` still refuses it."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        return None


def host(a: Any) -> Any:
    """A NumPy array of a tensor (copied from the device; a view of a CPU tensor); anything else as it is.

    A dtype NumPy lacks (bfloat16, float8) becomes float64 first, as `check_array` makes other dtypes.
    """
    if not isinstance(a, torch.Tensor):
        return a
    a = a.detach()
    if _numpy_name(a.dtype) is None:
        a = a.to(torch.float64)
    return a.cpu().numpy()


def like(result: Any, X: Any) -> Any:
    """`result` as the kind of array `X` is: a tensor on X's device, or X's own library's array (CuPy...) through
    DLPack; `result` as it is when X is not a device array or `result` is not numeric."""
    if not is_device_array(X) or result is None:
        return result
    if isinstance(result, np.ndarray):
        if result.dtype.kind not in "biuf":
            return result
        device = as_tensor(X).device
        result = torch.from_numpy(np.ascontiguousarray(result)).to(device)
    if isinstance(X, torch.Tensor):
        return result
    library = sys.modules.get(type(X).__module__.split(".")[0])
    convert = getattr(library, "from_dlpack", None)
    return convert(result) if convert is not None else result
