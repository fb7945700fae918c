"""A lab: one Keras script, on 1 process and on N ranks with hpdl.keras, ending on the same weights.

    hpdl launch -n 2 examples/lab_keras.py          (or -n 3, 4; KERAS_BACKEND=tensorflow for TensorFlow)

The script is a Horovod Keras script (`import hpdl.keras as hvd`). Rank 0
first fits the model alone on every global batch (the other ranks sleep),
then every rank fits its slice of each global batch with
hvd.DistributedOptimizer and the Horovod callbacks. It prints both speeds
and checks the claim: the N ranks end on the one process's weights.
"""

import argparse
import os
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "torch")  # before Keras is imported; the lab runs on either backend

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import hpdl.keras as hvd  # noqa: E402


def build(seed: int) -> keras.Model:
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)])
    rng = np.random.default_rng(seed)  # every rank builds the same initial weights (the broadcast makes sure)
    model.set_weights([rng.normal(size=w.shape).astype("float32") * 0.1 for w in model.get_weights()])
    return model


def fit(model: keras.Model, x, y, batch: int, epochs: int, callbacks=()) -> float:
    """Seconds of the epochs after the first (which traces the step and warms up)."""
    marks = []
    timer = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: marks.append(time.perf_counter()))
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=[*callbacks, timer])
    return marks[-1] - marks[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="global batch (divisible by the number of ranks)")
    args = parser.parse_args()
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    assert args.batch % size == 0, "the global batch must divide among the ranks"
    digits = load_digits()
    x, y = (digits.data / 16.0).astype("float32"), digits.target
    n = len(y) // args.batch * args.batch  # whole global batches only
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    samples = n * (args.epochs - 1)

    # 1. One process: rank 0 alone fits every global batch; the other ranks sleep until it is done.
    flag = hvd.broadcast_object(tempfile.mktemp(prefix="lab-keras-") if rank == 0 else None, root_rank=0)
    if rank == 0:
        alone = build(seed=0)
        alone.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss)
        seconds_one = fit(alone, x[:n], y[:n], args.batch, args.epochs)
        open(flag, "w").close()
    else:
        while not os.path.exists(flag):
            time.sleep(0.05)
    one = hvd.broadcast_object(
        ([w for w in alone.get_weights()], seconds_one) if rank == 0 else None, root_rank=0, name="one process"
    )
    if rank == 0:
        os.remove(flag)

    # 2. N ranks: the Horovod script. Each rank builds its own model (rank r's differs: the broadcast fixes it).
    model = build(seed=rank)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)), loss=loss)
    mine = np.concatenate([np.arange(b, b + args.batch)[rank::size] for b in range(0, n, args.batch)])
    seconds_n = fit(
        model, x[mine], y[mine], args.batch // size, args.epochs,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()],
    )  # fmt: skip

    difference = max(float(np.abs(a - b).max()) for a, b in zip(one[0], model.get_weights()))
    if rank == 0:
        print(f"Keras {keras.__version__} on {keras.backend.backend()}; digits, global batch {args.batch}")
        print(f"1 process : {samples / one[1]:8.0f} samples/s")
        print(f"{size} ranks   : {samples / seconds_n:8.0f} samples/s (hpdl.keras.DistributedOptimizer)")
        print(f"largest weight difference, {size} ranks vs 1 process: {difference:.1e}")
    assert difference < 1e-5, f"rank {rank}: the ranks' weights differ from one process's by {difference}"
    if rank == 0:
        print("PASS: the ranks end on the one process's weights")
    hvd.shutdown()


if __name__ == "__main__":
    main()
