"""hpdl.keras on the torch Keras backend, on 2 real ranks: data parallel fit equals one process, the callbacks,
load_model, the Keras pipeline, and the failures. (The TensorFlow backend: test_keras_tf.py, which reuses the bodies
here; 3 and 4 ranks: test_keras_ranks.py.)

The bodies import Keras on the ranks only: the pytest process never imports Keras or TensorFlow. One pool of 2
ranks per Keras backend (KERAS_BACKEND is read once, at Keras' import)."""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Optional

import numpy as np
import pytest

if importlib.util.find_spec("keras") is None:  # (not found without importing it: Keras takes seconds to import)
    pytest.skip("Keras is not installed (requirements-dev.txt: Python 3.11 to 3.13)", allow_module_level=True)

TORCH = {"KERAS_BACKEND": "torch"}
BATCH = 12  # the global batch: every rank fits its slice of each one
ROWS = 48


# ----------------------------------------------------------------------------------------------- shared by the bodies
def keras_setup(dtype: str) -> Any:
    import keras

    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)  # (the policy keeps the floatx of the first layer built in the process)
    return keras


def make_model(keras: Any, width: int = 16, seed: int = 1, shift: float = 0.0) -> Any:
    """A small MLP with weights from NumPy (keras.utils.set_random_seed would import TensorFlow on torch)."""
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(width, activation="tanh"), keras.layers.Dense(6), keras.layers.Dense(3)]
    )
    rng = np.random.default_rng(seed)
    model.set_weights([rng.normal(size=w.shape) * 0.4 + shift for w in model.get_weights()])
    return model


def data(dtype: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(ROWS, 8)).astype(dtype), rng.integers(0, 3, ROWS)


_LOSS: dict[str, Any] = {}


def mean_loss(keras: Any) -> Any:
    """Sparse cross-entropy, mean over the batch, summed per row / rows: Keras 3.15's torch backend reduces a
    float64 loss to float32 in its 'sum_over_batch_size' division (divide_no_nan), which would bound float64
    checks at 1e-8 in one process and on ranks alike."""
    if "class" not in _LOSS:

        class MeanCE(keras.losses.Loss):
            def call(self, y_true: Any, y_pred: Any) -> Any:
                ce = keras.ops.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
                return ce / keras.ops.cast(keras.ops.shape(y_pred)[0], y_pred.dtype)

        _LOSS["class"] = MeanCE
    return _LOSS["class"](reduction="sum", name="mean_ce")


def my_rows(rank: int, size: int) -> np.ndarray:
    """This rank's rows of every global batch of BATCH rows (interleaved: rank r takes rows r, r + size, ...)."""
    return np.concatenate([np.arange(b, b + BATCH)[rank::size] for b in range(0, ROWS, BATCH)])


_SETS: dict[tuple, Any] = {}


def dp_fit_body(
    comm: Any, dtype: str, eager: bool, passes: int = 1, epochs: int = 2, broadcast: bool = True,
    members: Optional[list] = None,
) -> Optional[dict]:  # fmt: skip
    """One process fitting every batch, and this rank fitting its slice (from different starting weights on rank
    1, which the broadcast callback replaces): the weights' distance, both runs' epoch losses. With `members`, only
    those ranks fit (a Horovod process set); the others return None."""
    import hpdl.keras as hvd

    keras = keras_setup(dtype)
    hvd.init()
    if members is not None and tuple(members) not in _SETS:
        _SETS[tuple(members)] = hvd.add_process_set(members)
    ps = hvd.global_process_set if members is None else _SETS[tuple(members)]
    if not ps.included():
        return None
    x, y = data(dtype)
    lr = 0.05

    def compile_(model: Any, optimizer: Any) -> None:
        model.compile(optimizer=optimizer, loss=mean_loss(keras), run_eagerly=eager, jit_compile="auto")

    ref = make_model(keras)
    compile_(ref, keras.optimizers.SGD(lr, momentum=0.9, gradient_accumulation_steps=passes if passes > 1 else None))
    # Horovod sums the passes of backward_passes_per_step; Keras' own accumulation averages them: rows of the
    # reference batch are the union of the passes' rows, so the reference sees passes x the rows per update.
    ref_history = ref.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)

    rank, size = ps.rank(), ps.size()
    model = make_model(keras, shift=0.5 * rank)
    start = [w.copy() for w in model.get_weights()]
    optimizer = hvd.DistributedOptimizer(
        keras.optimizers.SGD(lr, momentum=0.9), backward_passes_per_step=passes, average_aggregated_gradients=True,
        process_set=ps,
    )  # fmt: skip
    compile_(model, optimizer)
    callbacks = [hvd.callbacks.MetricAverageCallback(process_set=ps)]
    if broadcast:
        callbacks.insert(0, hvd.callbacks.BroadcastGlobalVariablesCallback(0, process_set=ps))
    rows = my_rows(rank, size)
    history = model.fit(
        x[rows], y[rows], batch_size=BATCH // size, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks
    )
    return {
        "error": max(float(np.abs(a - b).max()) for a, b in zip(ref.get_weights(), model.get_weights())),
        "start_moved": max(float(np.abs(a - b).max()) for a, b in zip(start, model.get_weights())),
        "loss": history.history["loss"],
        "ref_loss": ref_history.history["loss"],
        "weights": [w.tolist() for w in model.get_weights()],
        "class": type(model.optimizer).__name__,
        "jit": bool(model.jit_compile),
    }


def check_dp(results: list[dict], tolerance: float) -> None:
    for r in results:
        assert r["error"] < tolerance, r["error"]
        assert r["class"] == "SGD"
        np.testing.assert_allclose(r["loss"], r["ref_loss"], rtol=tolerance, atol=0)
        assert r["loss"] == results[0]["loss"]  # averaged: the same numbers on every rank
    for r in results[1:]:
        assert r["start_moved"] > 0.4  # ranks 1.. started 0.5 and more away from rank 0's weights, ended on them


# ---------------------------------------------------------------------------------------------------------- tests
# float64 on Keras 3.15.1's torch backend is not float64 throughout: one Dense layer's output differs from
# torch's own float64 `tanh(x @ W + b)` by 1.5e-7 in one process, so slices and whole batches part at 1e-8 to
# 1e-7 (the TensorFlow backend's float64 is exact: 1e-12 there, test_keras_tf.py).
TORCH_FLOAT64 = 1e-6


@pytest.mark.parametrize("dtype,tolerance", [("float64", TORCH_FLOAT64), ("float32", 1e-5)])
def test_two_ranks_fit_their_slices_as_one_process_fits_every_batch(ranks, dtype, tolerance):
    check_dp(ranks("mpi", 2, env=TORCH).run(dp_fit_body, dtype, False, timeout=240), tolerance)


def test_run_eagerly_and_backward_passes(ranks):
    pool = ranks("mpi", 2, env=TORCH)
    check_dp(pool.run(dp_fit_body, "float64", True), TORCH_FLOAT64)
    # Two passes of 6 rows per rank, then one update: the reference accumulates two batches of 12 as well.
    check_dp(pool.run(dp_fit_body, "float64", False, 2), TORCH_FLOAT64)


def test_without_the_broadcast_the_ranks_drift_apart(ranks):
    """The broadcast is what makes the ranks equal: the same fit without it ends on different weights."""
    first, second = ranks("mpi", 2, env=TORCH).run(dp_fit_body, "float64", False, 1, 1, False)
    assert first["error"] > 1e-3 and second["error"] > 0.1  # rank 0 too: it averaged rank 1's other gradients
    assert max(abs(a - b) for a, b in zip(np.ravel(first["weights"][0]), np.ravel(second["weights"][0]))) > 0.1


def callbacks_body(comm: Any, folder: str) -> dict:
    """Warm-up, a schedule, fp16 compression, the best-model checkpoint (rank 0 writes) and load_model."""
    import hpdl.keras as hvd

    keras = keras_setup("float32")
    hvd.init()
    x, y = data("float32")
    model = make_model(keras)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.5), compression=hvd.Compression.fp16)
    model.compile(optimizer=opt, loss=mean_loss(keras))
    lrs: list[float] = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: lrs.append(float(model.optimizer.learning_rate.numpy()))
    )
    path = os.path.join(folder, f"rank{hvd.rank()}", "best.keras")  # where this rank would write
    rows = my_rows(hvd.rank(), hvd.size())
    history = model.fit(
        x[rows], y[rows], batch_size=BATCH // hvd.size(), epochs=3, shuffle=False, verbose=0,
        validation_data=(x[rows], y[rows]),
        callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.MetricAverageCallback(),
            hvd.callbacks.LearningRateWarmupCallback(initial_lr=0.1, warmup_epochs=2, momentum_correction=True),
            hvd.callbacks.LearningRateScheduleCallback(initial_lr=0.1, multiplier=0.5, start_epoch=2),
            record,
            hvd.callbacks.BestModelCheckpoint(monitor="val_loss", filepath=path),
        ],
    )  # fmt: skip
    written = os.path.exists(path)
    hvd.allreduce(np.zeros(1), name="checkpoint written")  # rank 0 has saved before anyone loads
    saved = os.path.join(folder, "rank0", "best.keras")
    loaded = hvd.load_model(saved, custom_objects={"MeanCE": type(mean_loss(keras))}) if os.path.exists(saved) else None
    after = None
    if loaded is not None:
        loaded.fit(x[rows], y[rows], batch_size=BATCH // hvd.size(), epochs=1, shuffle=False, verbose=0)
        after = [w.tolist() for w in loaded.get_weights()]
    return {
        "lrs": lrs,
        "val_loss": history.history["val_loss"],
        "written": written,
        "loaded_class": type(loaded.optimizer).__name__ if loaded is not None else None,
        "loaded_distributed": hasattr(loaded.optimizer, "_hpdl") if loaded is not None else None,
        "after": after,
    }


def test_callbacks_checkpoint_and_load_model(ranks, tmp_path):
    results = ranks("mpi", 2, env=TORCH).run(callbacks_body, str(tmp_path), timeout=240)
    steps = ROWS // BATCH
    lrs = results[0]["lrs"]
    # Warm-up: from 0.1 / 2 up to 0.1 over 2 epochs, batch by batch; then the schedule's 0.1 * 0.5 from epoch 2.
    expected = [0.1 / 2 * ((e + b / steps) / 2 + 1) for e in range(2) for b in range(steps)] + [0.05] * steps
    np.testing.assert_allclose(lrs, expected, rtol=1e-6)
    assert results[0]["lrs"] == results[1]["lrs"]
    assert results[0]["val_loss"] == results[1]["val_loss"]
    assert [r["written"] for r in results] == [True, False]  # rank 0 writes; rank 1 kept `best` without writing
    assert [r["loaded_class"] for r in results] == ["SGD", "SGD"]
    assert all(r["loaded_distributed"] for r in results)
    assert results[0]["after"] == results[1]["after"]  # the rewrapped optimizer still averages


def keras_distribution_body(comm: Any) -> str:
    import hpdl.keras as hvd

    try:
        hvd.keras_data_parallel()
    except NotImplementedError as exc:
        return str(exc)
    return "ran"


def test_keras_own_data_parallel_on_torch_says_what_this_keras_lacks(ranks):
    """Keras 3.15.1 has no torch distribution_lib (keras#23418 came later): the call says so on every rank."""
    for message in ranks("mpi", 2, env=TORCH).run(keras_distribution_body):
        assert "3.15.1" in message and "distribution_lib" in message and "DistributedOptimizer" in message


# ----------------------------------------------------------------------------------------------- the Keras pipeline
def pipeline_body(comm: Any, schedule: str, steps: int, dp: int = 1) -> dict:
    """A Keras Sequential split into comm.size // dp stages (dp replicas of each), against one process: forward,
    gradients, and the weights after `steps` SGD steps, float64."""
    import torch

    import hpdl.keras as hvd

    keras = keras_setup("float64")
    hvd.init()
    x, y = data("float64")
    rows = x[:BATCH], y[:BATCH]
    pp = comm.size // dp
    replica, stage = divmod(comm.rank, pp)
    pp_comm = comm.split(replica, comm.rank)
    dp_comm = comm.split(stage, comm.rank) if dp > 1 else None
    ref = make_model(keras)
    ref_layers = [layer for layer in ref.layers]
    # One process: the gradients of the whole batch, then `steps` SGD steps on it.
    for v in ref.trainable_variables:
        v.value.grad = None
    loss = mean_loss(keras)(torch.tensor(rows[1]), ref(torch.tensor(rows[0])))
    loss.backward()
    ref_grads = {v.path: v.value.grad.clone() for v in ref.trainable_variables}
    ref_out = ref(torch.tensor(x)).detach().numpy()
    ref_opt = keras.optimizers.SGD(0.1, momentum=0.9)
    for _ in range(steps):
        for v in ref.trainable_variables:
            v.value.grad = None
        mean_loss(keras)(torch.tensor(rows[1]), ref(torch.tensor(rows[0]))).backward()
        with torch.no_grad():
            ref_opt.apply([v.value.grad for v in ref.trainable_variables], ref.trainable_variables)

    model = make_model(keras)
    mine = rows[0][replica::dp], rows[1][replica::dp]  # this replica's slice of the batch
    pipe = hvd.PipelineModel(model, pp_comm, chunks=3, schedule=schedule, data_parallel=dp_comm)
    pipe.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=mean_loss(keras))
    out = pipe.predict(x)
    grads = pipe.gradients(*mine)
    losses = [pipe.train_on_batch(*mine) for _ in range(steps)]
    index = {id(layer): i for i, layer in enumerate(model.layers)}
    names = [f"{ref_layers[index[id(layer)]].name}/{w.name}" for layer in pipe.layers for w in layer.weights]
    ref_by_name = {f"{layer.name}/{w.name}": w for layer in ref_layers for w in layer.weights}
    ref_grad_by_name = {f"{layer.name}/{w.name}": ref_grads[w.path] for layer in ref_layers for w in layer.weights}
    result = {
        "out": None if out is None else float(np.abs(out.detach().numpy() - ref_out).max()),
        "grad": max(float((g - ref_grad_by_name[n]).abs().max()) for g, n in zip(grads, names)),
        "weights": max(float(np.abs(w - ref_by_name[n].numpy()).max()) for w, n in zip(pipe.get_weights(), names)),
        "layers": len(pipe.layers),
        "losses": losses,
    }
    pipe.close()
    for c in (pp_comm, dp_comm):
        if c is not None:
            c.close()
    return result


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_keras_pipeline_on_two_stages_equals_one_process(ranks, schedule):
    results = ranks("mpi", 2, env=TORCH).run(pipeline_body, schedule, 3, timeout=240)
    assert results[0]["out"] is None and results[1]["out"] < TORCH_FLOAT64  # the output lives on the last stage
    assert [r["layers"] for r in results] == [2, 1]
    for r in results:
        assert r["grad"] < TORCH_FLOAT64 and r["weights"] < TORCH_FLOAT64
        assert r["losses"] == results[0]["losses"]


# ------------------------------------------------------------------ worker-local variables and elastic state
def local_parts_body(comm: Any, traced: bool = False) -> dict:
    """PartialDistributedOptimizer, BroadcastGlobalVariablesCallback(local_variables=) and elastic.KerasState, with
    rank-dependent values whose right results are exact in float64."""
    import hpdl.keras as hvd

    keras = keras_setup("float64")
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out: dict = {}
    # The optimizer: gradient (r + 1) everywhere; SGD(1.0) makes each update the applied gradient.
    for passes in (1, 2):
        model = make_model(keras)
        local = model.layers[:1]
        opt = hvd.PartialDistributedOptimizer(
            keras.optimizers.SGD(1.0), local_layers=local, backward_passes_per_step=passes, name=f"partial{passes}"
        )
        variables = model.trainable_variables
        before = [np.array(v.numpy()) for v in variables]
        grads = [keras.ops.full(v.shape, float(r + 1), dtype="float64") for v in variables]
        opt.build(variables)
        apply = _applier(opt, variables)
        if traced:
            import tensorflow as tf

            apply = tf.function(apply)
        for _ in range(passes):
            apply(grads)
        out[f"steps{passes}"] = [float(np.max(b - v.numpy())) - float(np.min(b - v.numpy()))
                                 for b, v in zip(before, variables)]  # fmt: skip
        out[f"step{passes}"] = [float(np.mean(b - v.numpy())) for b, v in zip(before, variables)]
        out["n_local"] = len(local[0].trainable_weights)
    # A scalar variable, updated eagerly (on TensorFlow a 0-d tensor through the bridge).
    scalar = keras.Variable(1.0, dtype="float64")
    scalar_opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), name="scalar")
    scalar_opt.apply([keras.ops.convert_to_tensor(float(r + 1), dtype="float64")], [scalar])
    out["scalar"] = float(scalar.numpy())
    try:
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(1.0), local_layers=["dense"])
    except ValueError as exc:
        out["bad_layer"] = str(exc)
    # The broadcast: every weight is the rank's number; the first layer's stay local.
    model = make_model(keras, shift=0.0)
    model.set_weights([np.full(w.shape, float(r)) for w in model.get_weights()])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=mean_loss(keras))
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(
        root_rank=n - 1, local_variables=model.layers[0].variables
    )
    callback.set_model(model)
    callback.on_train_begin()
    out["after_broadcast"] = [float(np.unique(w)[0]) if np.unique(w).size == 1 else None for w in model.get_weights()]
    # Elastic: sync takes rank 0's weights and attributes; restore returns to the last commit.
    model.set_weights([np.full(w.shape, float(r + 1)) for w in model.get_weights()])
    state = hvd.elastic.KerasState(model, batch=20 + r, epoch=10 + r)
    state.sync()
    synced = [float(np.max(np.abs(w - 1.0))) for w in model.get_weights()]
    out["synced"] = (max(synced), state.batch, state.epoch)
    model.set_weights([w * 0 + 7.0 for w in model.get_weights()])
    state.batch = 21
    state.restore()
    out["restored"] = (float(np.max(np.abs(model.get_weights()[0] - 1.0))), state.batch)
    commit = hvd.elastic.CommitStateCallback(state, batches_per_commit=2)
    model.set_weights([w * 0 + 7.0 for w in model.get_weights()])
    state.batch = 22
    commit.on_train_batch_end(0)  # not yet: every 2 batches
    state.restore()
    out["uncommitted"] = (float(model.get_weights()[0].flat[0]), state.batch)
    model.set_weights([w * 0 + 7.0 for w in model.get_weights()])
    state.batch = 22
    commit.on_train_batch_end(0)
    commit.on_train_batch_end(1)
    state.restore()
    out["committed"] = (float(model.get_weights()[0].flat[0]), state.batch)
    return out


def _applier(opt: Any, variables: list) -> Any:
    """`apply(grads)` with the variables in its closure: as tf.function arguments they would be traced as tensors."""
    return lambda grads: opt.apply(grads, variables)


def check_local_parts(results: list[dict]) -> None:
    n = len(results)
    for r, res in enumerate(results):
        k = res["n_local"]
        for passes in (1, 2):
            assert max(res[f"steps{passes}"]) < 1e-12  # one number per variable (w - (w - g) rounds)
            # Local variables: this rank's gradient / size (Horovod's scale_local_gradients); the others: the average.
            # With 2 passes Horovod sums them (average_aggregated_gradients=False).
            expected = [passes * (r + 1) / n] * k + [passes * (n + 1) / 2] * (len(res[f"step{passes}"]) - k)
            np.testing.assert_allclose(res[f"step{passes}"], expected, rtol=0, atol=1e-12)
        assert res["scalar"] == 1.0 - (n + 1) / 2
        assert "keras.layers.Layer" in res["bad_layer"] and "str" in res["bad_layer"]
        assert res["after_broadcast"] == [float(r)] * 2 + [float(n - 1)] * 4  # first layer's kernel and bias kept
        assert res["synced"] == (0.0, 20, 10)
        assert res["restored"] == (0.0, 20)
        assert res["uncommitted"] == (1.0, 20)
        assert res["committed"] == (7.0, 22)


def test_local_variables_partial_optimizer_and_elastic_state(ranks):
    check_local_parts(ranks("mpi", 2, env=TORCH).run(local_parts_body, timeout=120))


# ------------------------------------------------------------------------------------------------------- failures
def different_models_body(comm: Any) -> str:
    import hpdl.keras as hvd

    keras = keras_setup("float32")
    hvd.init()
    x, y = data("float32")
    model = make_model(keras, width=16 + hvd.rank())  # rank 1 wraps another model
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=mean_loss(keras))
    model.fit(x[:4], y[:4], batch_size=4, epochs=1, verbose=0)
    return "trained"


def skipped_step_body(comm: Any) -> str:
    import hpdl.keras as hvd

    keras = keras_setup("float32")
    hvd.init()
    x, y = data("float32")
    model = make_model(keras)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=mean_loss(keras))
    rows = 8 if hvd.rank() == 0 else 4  # rank 1 has one batch less: it skips the epoch's last step
    model.fit(x[:rows], y[:rows], batch_size=4, epochs=1, verbose=0, callbacks=[hvd.callbacks.MetricAverageCallback()])
    return "trained"


def test_ranks_that_wrap_different_models_fail_clearly(ranks):
    results = ranks("mpi", 2, env=TORCH).run(different_models_body, expect_errors=True, timeout=120)
    for error in results:
        assert error.type_name == "HorovodInternalError", error
        assert "mismatched shape" in error.message and "DistributedOptimizer.SGD" in error.message


def test_a_rank_that_skips_a_step_fails_clearly(ranks):
    results = ranks("mpi", 2, env=TORCH).run(skipped_step_body, expect_errors=True, timeout=120)
    for error in results:
        assert error.type_name == "HorovodInternalError", error
        assert "DistributedOptimizer.SGD" in error.message and "MetricAverageCallback" in error.message


# ------------------------------------------------------------------------------- hpdl bench keras, on the pool's ranks
def bench_body(comm: Any) -> list:
    """`hpdl bench keras --quick --models dense`'s rounds on these ranks (its launch runs the same on its own)."""
    from dataclasses import asdict

    from hpdl.bench.keras import Options, run_rounds

    return run_rounds(comm, asdict(Options(quick=True, models=("dense",), rounds=1, epochs=1)))


def check_bench_report(records: list, backend: str, capsys: Any, folder: str) -> str:
    """The report of one backend's records: every contender in the table, one accuracy for all, a target line."""
    from hpdl.bench.keras import BOUND, CONTENDERS, PEERS, SEPARATE, Options, write_report

    write_report(Options(quick=True, models=("dense",), rounds=1, epochs=1, out=folder), records, 1.0)
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines() if "| dense |" in line]
    expected = sorted(c for c in CONTENDERS[backend] if c not in SEPARATE)  # (SEPARATE: processes of their own)
    assert sorted(r[2] for r in rows if r[0] == backend) == expected, out
    accuracies = {r[5] for r in rows if r[2] != BOUND}  # (the bound's ranks drift apart: it trains on half)
    assert len(accuracies) == 1 and float(accuracies.pop()) > 0.5, out  # the same model, trained alike everywhere
    assert all(float(r[3]) > 0 for r in rows), out
    if any(c in PEERS for c in expected):  # (TensorFlow's peer runs in processes of its own: not on the pool)
        assert f"{backend} dense: hpdl.keras" in out and "the best peer" in out, out
    else:
        assert f"{backend} dense: no peer ran; hpdl.keras" in out, out
    assert "with no exchange at all the same ranks reach" in out, out  # the ceiling beside the target
    assert "MultiWorkerMirroredStrategy on Keras 2" in out
    assert os.path.exists(os.path.join(folder, "keras.json"))
    return out


def test_bench_keras_on_torch_prints_every_contender(ranks, capsys, tmp_path):
    records = ranks("mpi", 2, env=TORCH).run(bench_body, timeout=300)[0]
    check_bench_report(records, "torch", capsys, str(tmp_path))
