"""The per-call cost of hpdl.tensorflow's bridge (docs/keras.md quotes its output).

    python tests/scripts/tf_bridge_cost.py              # one process (the self backend)
    mpiexec -n 2 python tests/scripts/tf_bridge_cost.py # two ranks

Medians of microseconds per call: a tf.function that does nothing, one with a `tf.numpy_function` around an
identity, alone or with the HpdlStatus op after it (the bridge's node and its error op: `status_op`), or a
`tf.py_function`; `hvd.allreduce` of 4 floats eagerly and inside tf.function, the same allreduce through
`hpdl.horovod` (torch) and the raw communicator; and the conversions of a 4 MB tensor (a NumPy view or a copy
out of TensorFlow, DLPack or a copy into it).
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402

import hpdl  # noqa: E402
import hpdl.horovod as hvd_torch  # noqa: E402
import hpdl.tensorflow as hvd  # noqa: E402
from hpdl.tensorflow import status_op  # noqa: E402


def timed(fn, calls: int = 200, repeats: int = 5) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    hvd.init()
    small, small_torch = tf.ones([4]), torch.ones(4)
    big = tf.random.uniform([1024, 1024])
    big_np = np.ones((1024, 1024), np.float32)
    big_torch = torch.ones(1024, 1024)
    comm = hpdl.world()

    lib = status_op.library()

    def with_status(t):  # the bridge's node: the callback's outputs and status, then the op that raises it
        y, status = tf.numpy_function(lambda a: (a, b""), [t], [tf.float32, tf.string], stateful=True)
        return lib.hpdl_status(status, [y])[0] if lib is not None else y

    def graph(fn):  # a tf.function of one argument, called on `small`
        compiled = tf.function(fn)
        return lambda: compiled(small)

    rows = {
        "tf.function, empty": timed(graph(tf.identity)),
        "tf.function + numpy_function (identity)": timed(
            graph(lambda t: tf.numpy_function(lambda a: a, [t], tf.float32, stateful=True))
        ),
        "tf.function + numpy_function + HpdlStatus (identity)": timed(graph(with_status)),
        "tf.function + py_function (identity)": timed(graph(lambda t: tf.py_function(lambda a: a, [t], tf.float32))),
        "hvd.allreduce eager (hpdl.tensorflow)": timed(lambda: hvd.allreduce(small)),
        "hvd.allreduce in tf.function (hpdl.tensorflow)": timed(graph(hvd.allreduce)),
        "hvd.allreduce (hpdl.horovod, torch)": timed(lambda: hvd_torch.allreduce(small_torch)),
        "comm.allreduce (hpdl, torch)": timed(lambda: comm.allreduce(small_torch.clone())),
        "4 MB out of TF: _numpy() view": timed(lambda: big._numpy()),
        "4 MB out of TF: .numpy() copy": timed(lambda: big.numpy(), calls=50),
        "4 MB into TF: DLPack from torch": timed(
            lambda: tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(big_torch))
        ),
        "4 MB into TF: convert_to_tensor copy": timed(lambda: tf.convert_to_tensor(big_np), calls=50),
    }
    if hvd.rank() == 0:
        print(f"{hvd.size()} rank(s), backend {comm.backend}; microseconds per call (median of 5)")
        for name, us in rows.items():
            print(f"  {name:48s} {us:9.1f}")


if __name__ == "__main__":
    main()
