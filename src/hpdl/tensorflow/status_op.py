"""A small compiled TensorFlow op that gives graph-mode errors their class (`HpdlStatus`, status_op.cc).

Inside a graph, TensorFlow turns a Python exception raised in `tf.numpy_function` into an UnknownError (only
ValueError/TypeError, StopIteration, MemoryError and NotImplementedError get a class of their own), and no
TensorFlow op raises an error of a chosen class with a message known only at run time. So the bridge's callback
returns a status string beside its outputs, and `HpdlStatus` passes the outputs through (no copy) or raises that
status: FailedPreconditionError where ranks disagree, as Horovod raises it, with hpdl's message.

It is compiled with `g++` ($CXX) and TensorFlow's own flags the first time a graph needs it (about 5 s; one
process builds, the others wait for it) and cached in $XDG_CACHE_HOME/hpdl/tf-ops/, one file per TensorFlow
version and source. `python -m hpdl.tensorflow.status_op` builds it ahead (at install). Without a compiler, or
where it does not build or load, the bridge raises from its callback: graph-mode errors are then UnknownError
with the same message (a warning says so once).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Any, Iterator, Optional

import tensorflow as tf
from tensorflow.python.framework import ops as tf_ops

__all__ = ["FAILED_PRECONDITION", "INVALID_ARGUMENT", "build", "library", "library_path"]

FAILED_PRECONDITION = 9
INVALID_ARGUMENT = 3
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "status_op.cc")
BUILD_TIMEOUT = 300.0
"""Seconds a build may take, and a process waits for another's build, before the bridge goes on without the op."""

_LOCK = threading.Lock()
_LOADED: dict[str, Any] = {}


def library_path(cache: Optional[str] = None) -> str:
    """Where the compiled op is (or will be) for this TensorFlow and this source."""
    if cache is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        cache = os.path.join(base, "hpdl", "tf-ops")
    key = hashlib.sha256()
    with open(SOURCE, "rb") as handle:
        key.update(handle.read())
    for part in (tf.__version__, *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()):
        key.update(part.encode() + b"\0")
    return os.path.join(cache, f"hpdl_status_{key.hexdigest()[:16]}.so")


def build(path: str, compiler: Optional[str] = None) -> None:
    """Compile status_op.cc into `path` (written under another name and renamed: readers never see half a file).

    Raises RuntimeError (with the compiler's output) when it does not build."""
    compiler = compiler or os.environ.get("CXX") or "g++"
    found = shutil.which(compiler)
    if found is None:
        raise RuntimeError(f"no C++ compiler {compiler!r} on PATH (set CXX to one)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    command = [found, "-std=c++17", "-shared", "-fPIC", "-O2", "-w", SOURCE, "-o", partial,
               *tf.sysconfig.get_compile_flags(), *tf.sysconfig.get_link_flags()]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
        os.replace(partial, path)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"{compiler} took over {BUILD_TIMEOUT:.0f} s") from exc
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


@contextlib.contextmanager
def _exclusive(path: str) -> Iterator[None]:
    """One process builds; the others wait for it (at most BUILD_TIMEOUT s)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as handle:
        deadline = time.monotonic() + BUILD_TIMEOUT
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another process held {path}.lock for over {BUILD_TIMEOUT:.0f} s") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def library(cache: Optional[str] = None, compiler: Optional[str] = None) -> Optional[Any]:
    """The loaded op library (built first where missing), or None where it cannot be had (warned once)."""
    path = library_path(cache)
    with _LOCK:
        if path in _LOADED:
            return _LOADED[path]
        try:
            if not os.path.exists(path):
                with _exclusive(path):
                    if not os.path.exists(path):
                        build(path, compiler)
            lib = tf.load_op_library(path)
            with contextlib.suppress(KeyError):  # (registered once per process)
                tf_ops.NotDifferentiable("HpdlStatus")  # as the tf.numpy_function node before it
        except Exception as exc:  # noqa: BLE001 - any failure: the bridge raises from its callback instead
            warnings.warn(
                f"hpdl.tensorflow: the HpdlStatus op is not available ({exc}); errors of hpdl's collectives "
                "inside tf.function and TF1 graphs are UnknownError (same message) instead of "
                "FailedPreconditionError. Install g++ (or set CXX) to get Horovod's error classes.",
                RuntimeWarning,
                stacklevel=2,
            )
            lib = None
        _LOADED[path] = lib
        return lib


def main() -> None:
    """Build the op ahead (e.g. at install); prints where it is and how long the build took."""
    path = library_path()
    start = time.perf_counter()
    if library() is None:
        sys.exit(1)
    print(f"{path} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
