"""`hpdl bench keras`: Keras 3 data parallel on 2 ranks with hpdl.keras, against one process and against DDP.

One launch of 2 MPI ranks per Keras backend (on TensorFlow one per round,
alternating with MultiWorkerMirroredStrategy's); inside it the contenders
alternate round by round (A B C A B C ...), each on a convolutional and a
dense model of scikit-learn's digits, from the same initial weights, the
same data order and the same global batch:

    hpdl.keras     model.fit with hvd.DistributedOptimizer on 2 ranks (1 thread each), every rank its half of
                   each global batch
    one process    model.fit of the whole batch on rank 0 with 2 torch threads (rank 1 waits in a gloo barrier);
                   on TensorFlow 1 thread per pool, as every contender (TF's pools are fixed at start)
    keras+DDP      torch backend: the Keras model in torch's DistributedDataParallel over gloo, a plain loop
                   (Keras' fit calls the model, not a DDP wrapper), the Keras optimizer applying the gradients
    hpdl.keras loop  the same plain loop with hvd.DistributedOptimizer instead of DDP: the like-for-like peer
                   of keras+DDP (fit's own per-step cost is in neither)
    no exchange    not a contender but the bound: hpdl.keras's two ranks, each fitting its half of every global
                   batch with the bare optimizer, no gradient exchanged (the weights drift apart). No data
                   parallel Keras 3 fit on these cores can pass its speed: what the others lose to it is the
                   price of their exchange, and a target beyond it is out of reach here

    tf_keras MWMS  TensorFlow: `tf.distribute.MultiWorkerMirroredStrategy` on Keras 2 (tf_keras; with Keras 3
                   it is broken since TF 2.16, keras#20585), fit of a dataset of the global batches. Its two
                   processes are its own (TF's collective runtime is set up before any TF op, so it cannot share
                   the MPI ranks): on TensorFlow each round is a launch of the ranks and then one of MWMS.

On TensorFlow the report also gives the per-step cost of
hpdl.tensorflow's numpy_function bridge: the model's gradients reduced by a
`tf.function` through the bridge, against the same sizes through the
torch engine directly.

samples/s counts the global batch's rows per second of training (the
first epoch, which traces and warms up, is not timed). Accuracy is on the
held-out quarter of the digits after the same epochs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional, Sequence

import numpy as np

from hpdl.bench import report

__all__ = ["launch", "main", "MODELS", "CONTENDERS", "Options", "run_rounds", "write_report"]

MODELS = ("conv", "dense")
CONTENDERS = {
    "torch": ("hpdl.keras", "one process", "hpdl.keras loop", "keras+DDP", "no exchange"),
    "tensorflow": ("hpdl.keras", "one process", "tf_keras MWMS", "no exchange"),
}
SEPARATE = ("tf_keras MWMS",)
"""Contenders in processes of their own: TensorFlow's collective runtime must be set up before any TF op runs."""
PEERS = ("keras+DDP", "tf_keras MWMS")
"""The other data parallel tools; one process is the baseline every row is divided by, not a peer."""
BOUND = "no exchange"
"""The ceiling, not a peer: hpdl.keras's ranks without the gradient exchange."""
THREAD_VARIABLES = ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
"""1 thread per process for every contender: torch's and TensorFlow's pools (one process sets torch's to 2; TF's
are fixed when a process starts, and at these sizes 1 thread fits as fast as 2: docs/keras.md)."""
TARGET = 1.2
"""hpdl.keras on 2 ranks against the best peer that runs (issue #52)."""


@dataclass(frozen=True)
class Options:
    quick: bool = False
    out: str = "bench-results/keras"
    backends: tuple[str, ...] = ("torch", "tensorflow")
    models: tuple[str, ...] = MODELS
    rounds: int = 3
    epochs: int = 3
    batch: int = 128
    timeout: float = 900.0
    first_round: int = 0  # the number of a launch's first round (TensorFlow's launches run one round each)


def parse(argv: Sequence[str]) -> Options:
    parser = argparse.ArgumentParser(prog="hpdl bench keras", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 2 epochs (a check that it runs)")
    parser.add_argument("--out", default=Options.out)
    parser.add_argument("--backends", default="torch,tensorflow", help="Keras backends, comma-separated")
    parser.add_argument("--models", default="conv,dense", help="models, comma-separated (conv, dense)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None, help="timed epochs (after one untimed)")
    parser.add_argument("--batch", type=int, default=Options.batch, help="global batch (even)")
    parser.add_argument("--timeout", type=float, default=Options.timeout)
    args = parser.parse_args(list(argv))
    backends = tuple(b for b in args.backends.split(",") if b)
    for b in backends:
        if b not in CONTENDERS:
            parser.error(f"--backends: {b!r} is not one of {', '.join(CONTENDERS)}")
    models = tuple(m for m in args.models.split(",") if m)
    if not models or any(m not in MODELS for m in models):
        parser.error(f"--models: pick from {', '.join(MODELS)}")
    if args.batch < 2 or args.batch % 2:
        parser.error("--batch must be even (two ranks take half each)")
    quick = args.quick
    return Options(
        quick=quick, out=args.out, backends=backends, models=models, rounds=args.rounds or (1 if quick else 3),
        epochs=args.epochs or (1 if quick else 3), batch=args.batch, timeout=args.timeout,
    )  # fmt: skip


# --------------------------------------------------------------------------- the ranks
def _digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int64")
    order = np.random.default_rng(0).permutation(len(y))
    x, y = x[order], y[order]
    cut = len(y) * 3 // 4
    return x[:cut], y[:cut], x[cut:], y[cut:]


def _model(keras: Any, kind: str) -> Any:
    layers = keras.layers
    if kind == "conv":
        body = [layers.Conv2D(16, 3, activation="relu", padding="same"), layers.Conv2D(32, 3, activation="relu"),
                layers.Flatten(), layers.Dense(64, activation="relu")]  # fmt: skip
    else:
        body = [layers.Flatten(), layers.Dense(256, activation="relu"), layers.Dense(256, activation="relu")]
    model = keras.Sequential([keras.Input((8, 8, 1)), *body, layers.Dense(10)])
    rng = np.random.default_rng(1)  # He-normal kernels, zero biases: the same start for every contender
    model.set_weights([
        rng.normal(size=w.shape).astype("float32") * np.sqrt(2.0 / np.prod(w.shape[:-1])) if w.ndim > 1
        else np.zeros(w.shape, "float32") for w in model.get_weights()
    ])  # fmt: skip
    return model


def _my_rows(n: int, batch: int, rank: int, size: int) -> np.ndarray:
    """This rank's rows of every global batch (whole batches only, the same on every contender)."""
    return np.concatenate([np.arange(b, b + batch)[rank::size] for b in range(0, n - batch + 1, batch)])


class _Timer:
    """Keras callback: seconds of each epoch after the first."""

    def __init__(self, keras: Any):
        outer = self

        class Callback(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
                outer.started = time.perf_counter()

            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                if epoch > 0:
                    outer.seconds += time.perf_counter() - outer.started

        self.callback = Callback()
        self.seconds = 0.0
        self.started = 0.0


def _run_contender(name: str, kind: str, o: dict, comm: Any) -> Optional[dict]:
    """One timed run; the result on rank 0 (None elsewhere)."""
    import keras
    import torch
    import torch.distributed as dist

    import hpdl.keras as hvd

    x, y, x_test, y_test = _digits()
    batch, epochs = o["batch"], o["epochs"] + 1
    rows = _my_rows(len(y), batch, comm.rank, comm.size)
    whole = _my_rows(len(y), batch, 0, 1)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = _model(keras, kind)
    timer = _Timer(keras)
    if name in ("hpdl.keras", BOUND):
        torch.set_num_threads(1)
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
        model.compile(optimizer=hvd.DistributedOptimizer(optimizer) if name == "hpdl.keras" else optimizer, loss=loss)
        model.fit(x[rows], y[rows], batch_size=batch // comm.size, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), timer.callback])  # fmt: skip
        if name == BOUND:
            timer.seconds = max(comm.allgather_object(timer.seconds))  # unsynchronized ranks: the slower one's
    elif name == "one process":
        if comm.rank != 0:
            dist.barrier()  # a gloo barrier blocks in a socket read: the core is rank 0's
            return None
        torch.set_num_threads(2)
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss)
        model.fit(x[whole], y[whole], batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[timer.callback])  # fmt: skip
        torch.set_num_threads(1)
        dist.barrier()
    else:
        torch.set_num_threads(1)
        timer.seconds = _loop(keras, model, loss, x[rows], y[rows], batch // comm.size, epochs, ddp=name == "keras+DDP")
    if comm.rank != 0:
        return None
    accuracy = float(np.mean(np.argmax(keras.ops.convert_to_numpy(model.predict(x_test, verbose=0)), -1) == y_test))
    steps = len(whole) // batch
    return {"samples_per_s": steps * batch * (epochs - 1) / timer.seconds, "accuracy": accuracy}


def _loop(keras: Any, model: Any, loss: Any, x: np.ndarray, y: np.ndarray, batch: int, epochs: int, ddp: bool) -> float:
    """A plain training loop: the Keras model in torch's DDP over gloo (`ddp`), or the bare model with
    hvd.DistributedOptimizer; Keras' loss and Keras' optimizer either way."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import hpdl.keras as hvd

    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    if ddp:
        forward = DistributedDataParallel(model, process_group=_GLOO["group"])
    else:
        forward, optimizer = model, hvd.DistributedOptimizer(optimizer)
    optimizer.build(model.trainable_variables)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    seconds = 0.0
    for epoch in range(epochs):
        started = time.perf_counter()
        for b in range(0, len(y), batch):
            for v in model.trainable_variables:
                v.value.grad = None
            value = loss(yt[b : b + batch], forward(xt[b : b + batch]))
            value.backward()
            with torch.no_grad():
                optimizer.apply([v.value.grad for v in model.trainable_variables], model.trainable_variables)
        if epoch > 0:
            seconds += time.perf_counter() - started
    return seconds


_GLOO: dict[str, Any] = {}


def _bridge_cost(keras: Any, kind: str, repeats: int = 30) -> dict[str, float]:
    """Seconds per reduction of the model's gradients: through hpdl.tensorflow's bridge in a tf.function, and
    the same sizes through the torch engine directly; the difference is the bridge's per-step cost."""
    import tensorflow as tf
    import torch

    import hpdl.tensorflow as hvd_tf
    from hpdl.horovod import ops as torch_ops

    shapes = [tuple(w.shape) for w in _model(keras, kind).trainable_weights]
    tf_grads = [tf.ones(s) for s in shapes]
    torch_grads = [torch.ones(s) for s in shapes]

    @tf.function
    def reduce(grads: list) -> Any:
        return hvd_tf.grouped_allreduce(grads, name="bench.bridge")

    def run_tf() -> None:
        reduce(tf_grads)[0].numpy()

    def run_torch() -> None:
        torch_ops.grouped_allreduce(torch_grads, name="bench.direct")

    out = {}
    for label, fn in (("bridge_s", run_tf), ("direct_s", run_torch)):
        fn()  # traces (tf) and warms up
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        out[label] = float(np.median(times))
    return out


def run_rounds(comm: Any, o: dict) -> list[dict[str, Any]]:
    """Every round of every contender of this rank's Keras backend; the records on rank 0 (none elsewhere).

    Collective over `comm` (the MPI world); opens torch.distributed's gloo group for the peers when none is open.
    """
    import keras
    import torch.distributed as dist

    import hpdl.keras as hvd

    hvd.init()
    backend = keras.backend.backend()
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
    if "group" not in _GLOO:
        _GLOO["group"] = dist.new_group(backend="gloo")
    records: list[dict[str, Any]] = []
    for round_ in range(o["first_round"], o["first_round"] + o["rounds"]):
        for kind in o["models"]:
            for name in CONTENDERS[backend]:
                if name in SEPARATE:
                    continue
                result = _run_contender(name, kind, o, comm)
                if result is not None:
                    records.append({"backend": backend, "model": kind, "contender": name, "round": round_, **result})
    if backend == "tensorflow" and o["first_round"] == 0:
        for kind in o["models"]:
            cost = _bridge_cost(keras, kind)
            if comm.rank == 0:
                records.append({"backend": backend, "model": kind, "contender": "bridge", **cost})
    return records


def worker(spec_path: str) -> int:
    """The ranks of one backend (`python -m hpdl.bench.keras --worker spec.json`): run_rounds, rank 0 writes."""
    import torch.distributed as dist

    import hpdl

    with open(spec_path) as handle:
        spec = json.load(handle)
    comm = hpdl.init("mpi", timeout=spec["options"]["timeout"])
    records = run_rounds(comm, spec["options"])
    if comm.rank == 0:
        with open(spec["result"], "w") as handle:
            json.dump(records, handle)
    dist.destroy_process_group()
    hpdl.finalize()
    return 0


def mwms_worker(spec_path: str, index: int) -> int:
    """One worker of tf_keras on MultiWorkerMirroredStrategy (`--mwms-worker spec.json INDEX`)."""
    with open(spec_path) as handle:
        spec = json.load(handle)
    o = spec["options"]
    cluster = {"cluster": {"worker": spec["workers"]}, "task": {"type": "worker", "index": index}}
    os.environ["TF_CONFIG"] = json.dumps(cluster)
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()  # first: before any other TF op
    import tf_keras

    x, y, x_test, y_test = _digits()
    batch, epochs = o["batch"], o["epochs"] + 1
    whole = _my_rows(len(y), batch, 0, 1)
    shard = tf.data.Options()
    shard.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    records = []
    for round_ in range(o["first_round"], o["first_round"] + o["rounds"]):
        for kind in o["models"]:
            with strategy.scope():
                model = _model(tf_keras, kind)
                model.compile(optimizer=tf_keras.optimizers.SGD(0.05, momentum=0.9),
                              loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
            data = tf.data.Dataset.from_tensor_slices((x[whole], y[whole])).batch(batch).with_options(shard)
            timer = _Timer(tf_keras)
            model.fit(data, epochs=epochs, verbose=0, callbacks=[timer.callback])
            accuracy = float(np.mean(np.argmax(model.predict(x_test, verbose=0), -1) == y_test))
            steps = len(whole) // batch
            speed = steps * batch * (epochs - 1) / timer.seconds
            records.append({"backend": "tensorflow", "model": kind, "contender": "tf_keras MWMS", "round": round_,
                            "samples_per_s": speed, "accuracy": accuracy})  # fmt: skip
    if index == 0:
        with open(spec["result"], "w") as handle:
            json.dump(records, handle)
    return 0


def _has_tf_keras() -> bool:
    import importlib.util

    return importlib.util.find_spec("tf_keras") is not None


def _run_mwms(options: Options) -> list[dict[str, Any]]:
    """tf_keras on MultiWorkerMirroredStrategy in two processes of its own."""
    import socket
    import subprocess

    ports = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        spec = {"options": asdict(options), "result": result, "workers": [f"127.0.0.1:{p}" for p in ports]}
        path = os.path.join(tmp, "spec.json")
        with open(path, "w") as handle:
            json.dump(spec, handle)
        env = dict(os.environ, **dict.fromkeys(THREAD_VARIABLES, "1"), TF_CPP_MIN_LOG_LEVEL="2")
        print("hpdl bench keras: 2 processes of tf_keras on MultiWorkerMirroredStrategy ...", flush=True)
        procs = [subprocess.Popen([sys.executable, "-m", "hpdl.bench.keras", "--mwms-worker", path, str(i)], env=env)
                 for i in range(2)]  # fmt: skip
        try:
            codes = [p.wait(timeout=options.timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if codes != [0, 0]:
            raise RuntimeError(f"hpdl bench keras: the MultiWorkerMirroredStrategy workers exited with {codes}")
        with open(result) as handle:
            return list(json.load(handle))


# --------------------------------------------------------------------------- the launch and the report
def _run_backend(backend: str, options: Options) -> list[dict[str, Any]]:
    from hpdl.runtime import spawn

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        spec = {"options": asdict(options), "result": result}
        path = os.path.join(tmp, "spec.json")
        with open(path, "w") as handle:
            json.dump(spec, handle)
        env = spawn.job_environment("mpi", 2)
        env.update(dict.fromkeys(THREAD_VARIABLES, "1"), KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
        print(f"hpdl bench keras: 2 ranks, KERAS_BACKEND={backend} ...", flush=True)
        code = spawn.run(2, ["-m", "hpdl.bench.keras", "--worker", path], env=env, timeout=options.timeout,
                         name="keras")  # fmt: skip
        if code != 0:
            raise RuntimeError(f"hpdl bench keras: the {backend} ranks exited with code {code}")
        with open(result) as handle:
            return list(json.load(handle))


HEADERS = ["backend", "model", "contender", "samples/s (median)", "p10-p90", "accuracy", "vs one process"]


def table(records: list[dict[str, Any]]) -> tuple[str, list[str], list[str]]:
    """The Markdown table, the target lines and the bridge notes."""
    rows, verdicts, notes = [], [], []
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r["contender"] != "bridge":
            groups.setdefault((r["backend"], r["model"], r["contender"]), []).append(r)
    for backend in CONTENDERS:
        for model in MODELS:
            summary = {}
            for name in CONTENDERS[backend]:
                runs = groups.get((backend, model, name))
                if runs:
                    summary[name] = (report.summarize([r["samples_per_s"] for r in runs]), runs[-1]["accuracy"])
            if "one process" not in summary:
                continue
            base = summary["one process"][0]["median"]
            for name, (s, accuracy) in summary.items():
                rows.append([backend, model, name, f"{s['median']:.0f}", f"{s['p10']:.0f}-{s['p90']:.0f}",
                             f"{accuracy:.3f}", f"{s['median'] / base:.2f}x"])  # fmt: skip
            if "hpdl.keras" in summary:
                ours = {n: v[0]["median"] for n, v in summary.items() if n.startswith("hpdl.keras")}
                peers = {n: v[0]["median"] for n, v in summary.items() if n in PEERS}
                mine = max(ours, key=lambda n: ours[n])
                if peers:
                    best = max(peers, key=lambda n: peers[n])
                    ratio, against = ours[mine] / peers[best], peers[best]
                    line = (f"{report.verdict(ratio >= TARGET)} {backend} {model}: {mine} {ratio:.2f}x the best peer "
                            f"({best}) (target >= {TARGET}x), {ours[mine] / base:.2f}x one process")  # fmt: skip
                else:
                    against = base
                    line = f"{backend} {model}: no peer ran; {mine} {ours[mine] / base:.2f}x one process"
                if BOUND in summary:
                    ceiling = summary[BOUND][0]["median"] / against
                    line += f"; with no exchange at all the same ranks reach {ceiling:.2f}x" + (
                        f": {TARGET}x is out of reach on these cores" if peers and ceiling < TARGET else ""
                    )
                verdicts.append(line)
    for r in records:
        if r["contender"] == "bridge":
            extra = (r["bridge_s"] - r["direct_s"]) * 1e3
            notes.append(
                f"TF bridge, {r['model']} model's gradients: {r['bridge_s'] * 1e3:.2f} ms per step through the "
                f"numpy_function in a tf.function, {r['direct_s'] * 1e3:.2f} ms through the torch engine directly: "
                f"{extra:+.2f} ms per step for the bridge"
            )
    return report.markdown_table(HEADERS, rows, right_align_from=3), verdicts, notes


def write_report(options: Options, records: list[dict[str, Any]], elapsed: float) -> str:
    config = report.environment(benchmark="keras", **{k: v for k, v in asdict(options).items() if k != "out"})
    text_table, verdicts, bridge_notes = table(records)
    header = (
        f"hpdl bench keras{' --quick' if options.quick else ''}: {options.rounds} round(s), contenders alternating; "
        f"digits (1347 training rows), global batch {options.batch}, SGD(0.05, momentum 0.9), {options.epochs} "
        "timed epoch(s) after one untimed; 2 cores for every contender."
    )
    notes = [
        "hpdl.keras: model.fit with hvd.DistributedOptimizer, 2 MPI ranks x 1 thread, half of each global batch each.",
        "one process: model.fit of the whole batch, 2 torch threads (rank 1 waits in a gloo barrier); on "
        "TensorFlow 1 thread in each of TF's pools, as every contender (a process's pools are fixed when it "
        "starts; at these sizes one process fits as fast with 1 as with 2: docs/keras.md).",
        "keras+DDP: torch's DistributedDataParallel over gloo around the Keras model, in a plain loop (Keras' fit "
        "cannot call a DDP wrapper); hpdl.keras loop: the same loop with hvd.DistributedOptimizer; torch only.",
        "tf_keras MWMS: tf.distribute.MultiWorkerMirroredStrategy on Keras 2 (tf_keras; with Keras 3 it is broken "
        "since TF 2.16, keras#20585), 2 worker processes of its own x 1 thread; each round launches the ranks, "
        "then MWMS; absent from the table where tf_keras is not installed.",
        "no exchange: the bound, not a peer: hpdl.keras's 2 ranks fitting their halves with the bare optimizer, "
        "no gradient exchanged (the slower rank's time); no data parallel fit on these cores passes it.",
        *bridge_notes,
    ]
    text = report.markdown_document("hpdl bench keras", header, [text_table], notes, verdicts)
    report.write_report(options.out, "keras", text, records, config, elapsed)
    return text


def launch(argv: list[str]) -> int:
    """`hpdl bench keras [--quick] [--backends torch,tensorflow]`: the launches of each backend, the report."""
    return report.launch_parsed(parse, argv, _run_and_report)


def _run_and_report(options: Options) -> int:
    started = time.perf_counter()
    records: list[dict[str, Any]] = []
    mwms = _has_tf_keras()
    if "tensorflow" in options.backends and not mwms:
        print("hpdl bench keras: tf_keras is not installed; tf.distribute.MultiWorkerMirroredStrategy is left out")
    for backend in options.backends:
        if backend == "tensorflow" and mwms:
            # MWMS runs in processes of its own: the launches alternate with it, a round each
            for round_ in range(options.rounds):
                one = replace(options, rounds=1, first_round=round_)
                records += _run_backend(backend, one) + _run_mwms(one)
        else:
            records += _run_backend(backend, options)
    write_report(options, records, time.perf_counter() - started)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--worker"]:
        return worker(args[1])
    if args[:1] == ["--mwms-worker"]:
        return mwms_worker(args[1], int(args[2]))
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
