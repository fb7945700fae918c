"""hpdl.keras on the TensorFlow Keras backend, on 2 real ranks: the train step is a tf.function (run_eagerly=False)
whose gradients go through hpdl.tensorflow's numpy_function bridge, or eager; XLA is kept away. The bodies are
test_keras.py's (one pool of 2 ranks, KERAS_BACKEND=tensorflow)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("keras") is None or importlib.util.find_spec("tensorflow") is None:
    pytest.skip(
        "Keras or TensorFlow is not installed (requirements-dev.txt: Python 3.11 to 3.13)", allow_module_level=True
    )

from test_keras import (
    bench_body,
    check_bench_report,
    check_dp,
    check_local_parts,
    data,
    dp_fit_body,
    keras_setup,
    local_parts_body,
    make_model,
    mean_loss,
)

TF = {"KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.mark.parametrize(
    "dtype,eager,passes,tolerance",
    [
        ("float64", False, 1, 1e-12),
        ("float64", True, 1, 1e-12),
        ("float32", False, 1, 1e-5),
        ("float64", False, 2, 1e-12),
    ],
    ids=["float64-graph", "float64-eager", "float32-graph", "float64-graph-2-passes"],
)
def test_two_ranks_fit_their_slices_as_one_process_fits_every_batch(ranks, dtype, eager, passes, tolerance):
    results = ranks("mpi", 2, env=TF).run(dp_fit_body, dtype, eager, passes, timeout=300)
    check_dp(results, tolerance)
    assert not any(r["jit"] for r in results)  # jit_compile="auto" resolved to the non-XLA step


def test_local_variables_partial_optimizer_and_elastic_state_in_a_traced_step(ranks):
    """The local gradients are told apart inside a tf.function too (the variables are Python-side while tracing)."""
    check_local_parts(ranks("mpi", 2, env=TF).run(local_parts_body, True, timeout=300))


def jit_and_pipeline_body(comm: Any) -> dict:
    import hpdl.keras as hvd

    keras = keras_setup("float32")
    hvd.init()
    model = make_model(keras)
    out: dict = {}
    try:
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=mean_loss(keras),
                      jit_compile=True)  # fmt: skip
    except ValueError as exc:
        out["jit"] = str(exc)
    plain = make_model(keras)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=mean_loss(keras), jit_compile=True)
    out["plain_jit"] = plain.jit_compile  # (False here only where TensorFlow finds no XLA device)
    try:
        hvd.PipelineModel(model, comm)
    except NotImplementedError as exc:
        out["pipeline"] = str(exc)
    x, y = data("float32")
    out["tf_loaded"] = __import__("sys").modules.get("tensorflow") is not None
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=mean_loss(keras))
    model.fit(x, y, batch_size=12, epochs=1, verbose=0)
    return out


def test_xla_is_refused_clearly_and_the_pipeline_says_use_torch(ranks):
    for r in ranks("mpi", 2, env=TF).run(jit_and_pipeline_body, timeout=300):
        assert "jit_compile=True" in r["jit"] and "numpy_function" in r["jit"] and "jit_compile=False" in r["jit"]
        assert "KERAS_BACKEND=torch" in r["pipeline"]
        assert r["tf_loaded"]


def test_bench_keras_on_tensorflow_prints_its_table_and_the_bridge_cost(ranks, capsys, tmp_path):
    records = ranks("mpi", 2, env=TF).run(bench_body, timeout=300)[0]
    out = check_bench_report(records, "tensorflow", capsys, str(tmp_path))
    assert "TF bridge, dense model's gradients" in out and "ms per step for the bridge" in out
