"""hpdl.tensorflow (Horovod's TF2 API) on real MPI ranks: collectives' values, DistributedGradientTape equal to
one process on the whole batch (eagerly and inside tf.function), broadcast_variables, and mismatches that end
in hpdl's clear error. One pool of 2 TensorFlow ranks serves every test (a TF rank costs seconds to start);
the bodies import TensorFlow on the ranks only, never in the pytest process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import RankError

TF_ENV = {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}
"""The environment of the TensorFlow pool: the one tests/test_keras_tf.py uses, so that one pool of 2 TensorFlow
ranks serves both files (other files' ranks stay free of TensorFlow)."""

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed (pip install hpdl[tensorflow])"
)


def test_import_hpdl_does_not_import_tensorflow():
    code = "import sys, hpdl; assert 'tensorflow' not in sys.modules, 'tensorflow was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- collectives
def collectives_body(comm):
    import tensorflow as tf

    import hpdl.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x = tf.fill([3], float(r + 1))

    def run_all(tag):
        out = {}
        out[f"{tag}avg"] = hvd.allreduce(x)
        out[f"{tag}sum"] = hvd.allreduce(x, op=hvd.Sum)
        out[f"{tag}scaled"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
        out[f"{tag}fp16"] = hvd.allreduce(tf.cast(x, tf.float64), compression=hvd.Compression.fp16)
        out[f"{tag}adasum"] = hvd.allreduce(x, op=hvd.Adasum)
        out[f"{tag}grouped"] = hvd.grouped_allreduce([x, tf.cast(x, tf.int64) * 2], op=hvd.Sum)
        out[f"{tag}gather"] = hvd.allgather(tf.fill([r + 1, 2], float(r)))
        out[f"{tag}bcast"] = hvd.broadcast(tf.constant([float(r)]), root_rank=n - 1)
        out[f"{tag}a2a"] = hvd.alltoall(tf.range(3) + 10 * r, splits=tf.constant([1, 2]) if r == 0 else [2, 1])
        out[f"{tag}rs"] = hvd.reducescatter(tf.reshape(tf.range(6, dtype=tf.float64) * (r + 1), [3, 2]), op=hvd.Sum)
        sparse = tf.IndexedSlices(tf.fill([1, 2], float(r + 1)), tf.constant([r]), tf.constant([4, 2]))
        out[f"{tag}sparse"] = tf.convert_to_tensor(hvd.allreduce(sparse))
        return out

    out = {**run_all(""), **tf.function(lambda: run_all("fn_"))()}  # graph nodes: how model.fit runs a step
    out = {k: ([t.numpy() for t in v] if isinstance(v, (list, tuple)) else v.numpy()) for k, v in out.items()}
    out["fp16_dtype"] = str(hvd.allreduce(tf.cast(x, tf.float64), compression=hvd.Compression.fp16).dtype.name)
    out["gather_shape_in_fn"] = tf.function(lambda t: hvd.allgather(t)).get_concrete_function(x).output_shapes
    out["unchanged"] = x.numpy()

    v = tf.Variable(tf.fill([2, 2], float(r)), dtype=tf.float32)
    hvd.broadcast_variables([v], root_rank=1)
    out["broadcast_variables"] = v.numpy()
    out["object"] = hvd.broadcast_object({"from": r} if r == 0 else None, root_rank=0)
    out["objects"] = hvd.allgather_object(("rank", r))
    one = hvd.add_process_set([0])
    out["set"] = hvd.allreduce(x, op=hvd.Sum, process_set=one).numpy() if r == 0 else None
    hvd.remove_process_set(one)

    @tf.function(jit_compile=True)
    def xla(t):
        return hvd.allreduce(t)

    try:
        xla(x)
        out["xla"] = "ran"
    except NotImplementedError as exc:
        out["xla"] = str(exc)
    return out


def test_collectives(ranks):
    for r, out in enumerate(ranks("mpi", 2, TF_ENV).run(collectives_body, timeout=120)):
        for tag in ("", "fn_"):
            np.testing.assert_array_equal(out[f"{tag}avg"], [1.5] * 3)
            np.testing.assert_array_equal(out[f"{tag}sum"], [3.0] * 3)
            np.testing.assert_array_equal(out[f"{tag}scaled"], [3.0] * 3)
            np.testing.assert_array_equal(out[f"{tag}fp16"], [1.5] * 3)
            np.testing.assert_allclose(out[f"{tag}adasum"], [1.5] * 3)  # parallel: Adasum averages
            np.testing.assert_array_equal(out[f"{tag}grouped"][0], [3.0] * 3)
            np.testing.assert_array_equal(out[f"{tag}grouped"][1], [6] * 3)
            np.testing.assert_array_equal(out[f"{tag}gather"], [[0, 0], [1, 1], [1, 1]])
            np.testing.assert_array_equal(out[f"{tag}bcast"], [1.0])
            np.testing.assert_array_equal(out[f"{tag}a2a"][0], [0, 10, 11] if r == 0 else [1, 2, 12])
            np.testing.assert_array_equal(out[f"{tag}a2a"][1], [1, 2] if r == 0 else [2, 1])
            full = np.arange(6.0).reshape(3, 2) * 3
            np.testing.assert_array_equal(out[f"{tag}rs"], full[:2] if r == 0 else full[2:])
            np.testing.assert_array_equal(out[f"{tag}sparse"], [[0.5, 0.5], [1.0, 1.0], [0, 0], [0, 0]])
        assert out["fp16_dtype"] == "float64"
        assert out["gather_shape_in_fn"].as_list() == [None]
        np.testing.assert_array_equal(out["unchanged"], [r + 1.0] * 3)
        np.testing.assert_array_equal(out["broadcast_variables"], np.ones((2, 2)))
        assert out["object"] == {"from": 0} and out["objects"] == [("rank", 0), ("rank", 1)]
        if r == 0:
            np.testing.assert_array_equal(out["set"], [1.0] * 3)
        assert "jit_compile=True" in out["xla"] and "XLA" in out["xla"]


# --------------------------------------------------------------------------- training equals one process
def training_body(comm, mode, steps):
    """Fit a small model (an embedding with sparse gradients, a dense layer, float64) for `steps` SGD steps:
    each rank on its slice of every global batch with DistributedGradientTape, and, on every rank, one
    process on the whole batch with a plain tape. Returns both weight sets."""
    import tensorflow as tf

    import hpdl.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    rng = np.random.default_rng(0)
    batch = 4 * n
    ids = rng.integers(0, 10, size=(steps, batch))
    feats = rng.normal(size=(steps, batch, 3))
    target = rng.normal(size=(steps, batch, 1))

    def model(seed):
        g = np.random.default_rng(seed)
        return [tf.Variable(g.normal(size=shape)) for shape in [(10, 3), (6, 1), (1,)]]

    def loss_fn(w, i, f, y):
        h = tf.concat([tf.gather(w[0], i), f], axis=1)  # tf.gather: the embedding's gradient is IndexedSlices
        return tf.reduce_mean((tf.tanh(h) @ w[1] + w[2] - y) ** 2)

    def apply(w, grads):
        for v, g in zip(w, grads):
            v.assign_sub(0.1 * tf.convert_to_tensor(g))

    def distributed_step(w, i, f, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(w, i, f, y)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, w)
        apply(w, grads)
        return isinstance(grads[0], tf.IndexedSlices)

    def single_step(w, i, f, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(w, i, f, y)
        apply(w, tape.gradient(loss, w))

    if mode == "function":
        distributed_step = tf.function(distributed_step)
        single_step = tf.function(single_step)
    mine = model(seed=100 + r)  # different starting weights on every rank: the broadcast makes them equal
    hvd.broadcast_variables(mine, root_rank=0)
    reference = model(seed=100)
    lo, hi = r * 4, (r + 1) * 4
    sparse = []
    for s in range(steps):
        sparse.append(bool(distributed_step(mine, ids[s, lo:hi], feats[s, lo:hi], target[s, lo:hi])))
        single_step(reference, ids[s], feats[s], target[s])
    return [v.numpy() for v in mine], [v.numpy() for v in reference], sparse


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_distributed_gradient_tape_equals_one_process(ranks, mode):
    results = ranks("mpi", 2, TF_ENV).run(training_body, mode, 3, timeout=120)
    for mine, reference, sparse in results:
        assert all(sparse)  # the embedding's gradient stayed IndexedSlices (gathered, as Horovod does)
        for got, want in zip(mine, reference):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    for got, want in zip(results[0][0], results[1][0]):
        np.testing.assert_array_equal(got, want)


def partial_tape_body(comm):
    import keras
    import tensorflow as tf

    import hpdl.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    shared = keras.layers.Dense(2, kernel_initializer="ones")
    local = keras.layers.Dense(1, kernel_initializer="ones")
    x = tf.fill([1, 3], float(r + 1))
    local(shared(x))
    variables = shared.trainable_weights + local.trainable_weights

    def partial():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(local(shared(x)))
        tape = hvd.PartialDistributedGradientTape(tape, local_layers=[local])
        return tape.gradient(loss, variables)

    def own():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(local(shared(x)))
        return tape.gradient(loss, variables)

    # eagerly, and traced (how a train step runs)
    runs = [partial(), tf.function(partial)()]
    grads = [[g.numpy() for g in grads] for grads in runs], [g.numpy() for g in own()], n
    local.kernel.assign(tf.fill([2, 1], float(r + 5)))  # Keras 3 variables (not tf.Variable) broadcast too
    hvd.broadcast_variables(local.variables, root_rank=1)
    return (*grads, local.kernel.numpy())


def test_partial_distributed_gradient_tape(ranks):
    results = ranks("mpi", 2, TF_ENV).run(partial_tape_body, timeout=120)
    owns = [own for _, own, _, _ in results]
    for runs, own, n, kernel in results:
        np.testing.assert_array_equal(kernel, np.full((2, 1), 6.0))
        for grads in runs:
            np.testing.assert_allclose(grads[0], (owns[0][0] + owns[1][0]) / 2)  # shared kernel: averaged
            np.testing.assert_allclose(grads[2], own[2] / n)  # local kernel: its own, scaled by 1/size (Horovod)
    assert not np.allclose(results[0][0][0][2], results[1][0][0][2])


# --------------------------------------------------------------------------- mismatches
def mismatch_body(comm, case):
    import tensorflow as tf

    import hpdl.tensorflow as hvd

    hvd.init()
    r = hvd.rank()
    if case == "shape":
        hvd.allreduce(tf.ones([3 + r]))
    elif case == "op_in_function":

        @tf.function
        def step(t):
            return hvd.allreduce(t) if r == 0 else hvd.allgather(t)

        step(tf.ones([2]))
    return "no error"


@pytest.mark.parametrize("case", ["shape", "op_in_function"])
def test_mismatch_ends_in_a_clear_error(ranks, case):
    pool = ranks("mpi", 2, TF_ENV)
    results = pool.run(mismatch_body, case, timeout=60, expect_errors=True)
    for r, res in enumerate(results):
        assert isinstance(res, RankError), f"rank {r}: {res}"
        if case == "shape":
            assert res.type_name == "HorovodInternalError"  # a tf.errors.FailedPreconditionError, as Horovod's
            assert "mismatched shape" in res.message and "(3,)" in res.message and "(4,)" in res.message
        else:
            assert res.type_name == "FailedPreconditionError"  # from the graph's HpdlStatus op, as Horovod's
            assert "allreduce" in res.message and "allgather" in res.message
    assert pool.run(collectives_ok_body, timeout=60) == [[2.0, 2.0]] * 2  # the ranks are still in step


def graph_errors_body(comm):
    import os
    import tempfile
    import warnings

    import tensorflow as tf

    import hpdl.tensorflow as hvd

    hvd.init()
    r = hvd.rank()

    def outcome(fn, *args):
        try:
            fn(*args)
            return "no error"
        except Exception as exc:  # noqa: BLE001 - the class is what is tested
            return type(exc).__name__, getattr(exc, "message", str(exc))

    out = {
        "shape": outcome(tf.function(lambda: hvd.allreduce(tf.ones([3 + r])))),
        "argument": outcome(tf.function(lambda: hvd.alltoall(tf.ones([3]), splits=[2, 2]))),
    }
    with tf.Graph().as_default(), tf.compat.v1.Session() as session:  # a TF1 graph, as Horovod's graph-mode tests
        out["session"] = outcome(session.run, hvd.allgather(tf.ones([2, 1 + r])))
    saved = {k: os.environ.get(k) for k in ("XDG_CACHE_HOME", "CXX")}
    with tempfile.TemporaryDirectory() as cache, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        os.environ.update(XDG_CACHE_HOME=cache, CXX="hpdl-no-such-compiler")  # the op cannot be built
        try:
            out["no_op"] = outcome(tf.function(lambda: hvd.allreduce(tf.ones([3 + r]))))
        finally:
            os.environ.update({k: v for k, v in saved.items() if v is not None})
            for k in (k for k, v in saved.items() if v is None):
                del os.environ[k]
        out["warned"] = [str(w.message) for w in caught]
    return out


def test_graph_errors_have_horovods_classes(ranks):
    """Inside tf.function and TF1 sessions hpdl's errors keep their class (FailedPreconditionError where ranks
    disagree, InvalidArgumentError for bad arguments) and message; without a compiler they are UnknownError."""
    pool = ranks("mpi", 2, TF_ENV)
    for out in pool.run(graph_errors_body, timeout=120):
        assert out["shape"][0] == "FailedPreconditionError" and "mismatched shape" in out["shape"][1]
        assert out["argument"][0] == "InvalidArgumentError" and "splits" in out["argument"][1]
        assert out["session"][0] == "FailedPreconditionError" and "mismatched shape" in out["session"][1]
        assert out["no_op"][0] == "UnknownError" and "mismatched shape" in out["no_op"][1]
        assert any("HpdlStatus op is not available" in w and "hpdl-no-such-compiler" in w for w in out["warned"])
    assert pool.run(collectives_ok_body, timeout=60) == [[2.0, 2.0]] * 2


def collectives_ok_body(comm):
    import tensorflow as tf

    import hpdl.tensorflow as hvd

    return hvd.allreduce(tf.ones([2]), op=hvd.Sum).numpy().tolist()


# --------------------------------------------------------------------------- SyncBatchNormalization
def sync_batch_norm_body(comm, steps):
    """Dense -> SyncBatchNormalization -> Dense in float64, `steps` SGD steps eagerly and in tf.function: rank r
    fits rows of its own count (4 (r + 1): unequal shares) of every global batch with DistributedGradientTape;
    one process fits the whole batch with Keras' BatchNormalization. Returns the largest difference of any
    weight (moving statistics included) per mode, and the output on a rank's slice in inference."""
    import keras
    import tensorflow as tf

    import hpdl.tensorflow as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    sizes = [4 * (k + 1) for k in range(n)]
    lo, hi, batch = sum(sizes[:r]), sum(sizes[: r + 1]), sum(sizes)
    rng = np.random.default_rng(0)
    xs, ys = rng.normal(3.0, 2.0, (steps, batch, 4)), rng.normal(size=(steps, batch, 1))

    def model(norm):
        keras.utils.set_random_seed(1)  # the same Dense weights in both models
        layers = [keras.layers.Dense(3, dtype="float64"), norm(momentum=0.5, dtype="float64")]
        return keras.Sequential([keras.Input((4,), dtype="float64"), *layers, keras.layers.Dense(1, dtype="float64")])

    def fit(m, distributed, mode):
        def step(x, y):
            with tf.GradientTape() as tape:  # the global batch's mean loss: this rank's share of its sum, times n
                loss = tf.reduce_sum((m(x, training=True) - y) ** 2) / batch * (n if distributed else 1)
            if distributed:
                tape = hvd.DistributedGradientTape(tape)
            for v, g in zip(m.trainable_variables, tape.gradient(loss, m.trainable_variables)):
                v.assign_sub(0.1 * g)

        step = tf.function(step) if mode == "function" else step
        for s in range(steps):
            step(xs[s, lo:hi], ys[s, lo:hi]) if distributed else step(xs[s], ys[s])
        return m

    out = {}
    for mode in ("eager", "function"):
        mine = fit(model(hvd.SyncBatchNormalization), True, mode)
        reference = fit(model(keras.layers.BatchNormalization), False, mode)
        out[mode] = max(float(np.max(np.abs(a.numpy() - b.numpy()))) for a, b in zip(mine.weights, reference.weights))
        out[f"{mode}_moved"] = float(np.max(np.abs(mine.layers[1].moving_mean.numpy())))
    x = xs[0, lo:hi]
    out["inference"] = float(np.max(np.abs(mine(x, training=False).numpy() - reference(x, training=False).numpy())))
    return out


def test_sync_batch_normalization_equals_one_process_on_the_whole_batch(ranks):
    for out in ranks("mpi", 2, TF_ENV).run(sync_batch_norm_body, 3, timeout=120):
        for mode in ("eager", "function"):
            assert out[f"{mode}_moved"] > 0.1  # the moving statistics were updated (from the global batch)
            assert out[mode] < 1e-12, out
        assert out["inference"] < 1e-12


SHARE_CORES = """
import os
import tensorflow as tf
from hpdl.runtime.spawn import threads_per_rank
from hpdl.tensorflow import threads
pools = tf.config.threading
for name in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
    os.environ.pop(name, None)
os.environ["TF_NUM_INTRAOP_THREADS"] = "4"
assert threads.share_cores(2) is None and pools.get_intra_op_parallelism_threads() == 0  # TensorFlow's own variable
del os.environ["TF_NUM_INTRAOP_THREADS"]
assert threads.share_cores(1) is None and pools.get_intra_op_parallelism_threads() == 0  # one rank: TF's own sizing
assert threads.share_cores(2) == threads_per_rank(2)  # the cores over the ranks of this host
assert pools.get_intra_op_parallelism_threads() == pools.get_inter_op_parallelism_threads() == threads_per_rank(2)
os.environ["OMP_NUM_THREADS"] = "3"
assert threads.share_cores(2) is None, "a size chosen before (by the user, with tf.config.threading) stays"
pools.set_intra_op_parallelism_threads(0)
pools.set_inter_op_parallelism_threads(0)
assert threads.share_cores(2) == 3 and pools.get_inter_op_parallelism_threads() == 3  # OMP_NUM_THREADS, if set
pools.set_intra_op_parallelism_threads(0)
pools.set_inter_op_parallelism_threads(0)
assert float(tf.reduce_sum(tf.ones([4]))) == 4.0  # the runtime starts: its pools are fixed now
assert threads.share_cores(2) is None and pools.get_intra_op_parallelism_threads() == 0
print("checked")
"""


def test_tensorflow_pools_get_this_ranks_share_of_the_cores_unless_the_user_chose():
    """TensorFlow sizes its pools to the whole machine and ignores OMP_NUM_THREADS (docs/keras.md: the cost on
    2 ranks of 2 cores). `hpdl launch` sets TF's variables (test_launcher.py); init covers mpirun/srun.
    A fresh process: TensorFlow's pools can be sized only before its runtime starts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TF_NUM_", "OMP_NUM"))}
    done = subprocess.run([sys.executable, "-c", SHARE_CORES], env={**env, "TF_CPP_MIN_LOG_LEVEL": "3"},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-3000:]
