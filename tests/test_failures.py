"""Never hang, never lie: bad input, skipped and mismatched collectives, errors after finalize."""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch

import hpdl
from conftest import RankError
from hpdl.comm.self_backend import SelfCommunicator

PARALLEL = [("mpi", 2), ("torch", 2), ("mpi", 3), ("torch", 3)]


# ---------------------------------------------------------------- bad input: clear errors, raised before any wait
def bad_inputs(comm):
    cases = {
        "non-contiguous": lambda: comm.allreduce(torch.ones(4, 4).t()),
        "avg on ints": lambda: comm.allreduce(torch.ones(3, dtype=torch.int32), op="avg"),
        "unknown op": lambda: comm.allreduce(torch.ones(3), op="mean"),
        "root out of range": lambda: comm.broadcast(torch.ones(3), root=comm.size),
        "not divisible": lambda: comm.reduce_scatter(torch.ones(comm.size * 2 + 1)),
        "alltoall not divisible": lambda: comm.alltoall(torch.ones(comm.size + 1)),
        "not a tensor": lambda: comm.allreduce([1.0, 2.0]),
        "send to self": lambda: comm.send(torch.ones(1), comm.rank),
        "bad sizes": lambda: comm.allgather(torch.ones(2), sizes=[3] * comm.size),
        "bad color": lambda: comm.split(-2),
        "max on complex": lambda: comm.allreduce(torch.ones(2, dtype=torch.complex64), op="max"),
    }
    if comm.size == 1:  # every dim 0 divides by one rank
        del cases["not divisible"], cases["alltoall not divisible"]
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = None
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    # The communicator is still healthy afterwards.
    out["after"] = comm.allreduce(torch.ones(1)).item()
    return out


EXPECTED_WORDS = {
    "non-contiguous": "contiguous()",
    "avg on ints": "floating-point",
    "unknown op": "sum, avg, max, min, prod",
    "root out of range": "out of range",
    "not divisible": "divide evenly",
    "alltoall not divisible": "divide evenly",
    "not a tensor": "torch.Tensor or numpy.ndarray",
    "send to self": "this rank itself",
    "bad sizes": "dim-0 sizes",
    "bad color": "non-negative",
    "max on complex": "complex",
}


@pytest.mark.parametrize("backend,nprocs", [("self", 1), ("mpi", 2), ("torch", 2)])
def test_bad_input_is_a_clear_error(ranks, backend, nprocs):
    for out in ranks(backend, nprocs).run(bad_inputs):
        assert out.pop("after") == nprocs
        for name, message in out.items():
            assert message is not None, f"{name} was accepted"
            assert EXPECTED_WORDS[name] in message, (name, message)


# ---------------------------------------------------------------- a rank that skips a collective
def rank0_skips(comm):
    comm.allreduce(torch.ones(1))  # collective #1 on every rank
    if comm.rank == 0:
        time.sleep(4)  # busy elsewhere: never calls collective #2
        return "skipped"
    comm.timeout = 2.0
    started = time.perf_counter()
    try:
        comm.allreduce(torch.ones(1))
    finally:
        comm._hpdl_elapsed = time.perf_counter() - started  # type: ignore[attr-defined]
    return "completed"


@pytest.mark.parametrize("backend,nprocs", PARALLEL)
def test_skipped_collective_times_out_naming_the_missing_rank(ranks, backend, nprocs):
    started = time.monotonic()
    results = ranks(backend, nprocs).run(rank0_skips, expect_errors=True, timeout=60)
    elapsed = time.monotonic() - started
    assert results[0] == "skipped"
    for error in results[1:]:
        assert isinstance(error, RankError) and error.type_name == "CommTimeoutError", error
        assert "allreduce #" in error.message and "within 2.0 s" in error.message
        assert "rank 0" in error.message, error.message
        assert "HPDL_DEBUG=1" in error.message
    assert elapsed < 30


def rank0_finishes_early(comm, n):
    """Rank 0 closes a communicator (as hpdl.finalize does at the end of a script) while the others call one
    more collective on it: MPI would pair their allreduce with its exit barrier and return garbage."""
    sub = comm.split(0, comm.rank)
    sub.allreduce(torch.ones(n))
    started = time.perf_counter()
    if comm.rank == 0:
        sub.close()
        return time.perf_counter() - started, None
    try:
        got = sub.allreduce(torch.full((n,), 5.0))
    except Exception as exc:  # noqa: BLE001 - the type and message are what the test checks
        return time.perf_counter() - started, f"{type(exc).__name__}: {exc}"
    return time.perf_counter() - started, f"returned {got[:3].tolist()}"


@pytest.mark.parametrize(
    "backend,nprocs,n",
    [("mpi", 2, 1), ("mpi", 2, 100_000), ("mpi", 3, 1), ("mpi", 3, 100_000), ("torch", 2, 1), ("torch", 3, 100_000)],
)
def test_rank_that_finishes_early_is_an_error_on_every_rank_not_garbage(ranks, backend, nprocs, n):
    results = ranks(backend, nprocs).run(rank0_finishes_early, n, timeout=60)
    closing, _ = results[0]
    assert closing < 10  # it saw that the others wait in a collective it never called (not 30 s)
    for waited, error in results[1:]:
        assert error is not None and error.startswith("CollectiveMismatchError"), error
        assert "rank 0 (after 1 collectives) finished" in error and "allreduce #2" in error, error
        assert waited < 10


# ---------------------------------------------------------------- debug mode
def mismatched(comm, kind):
    comm.debug = True
    x = torch.ones(4)
    if kind == "op":
        if comm.rank == 0:
            comm.allreduce(x)
        else:
            comm.broadcast(x, root=0)
    elif kind == "shape":
        comm.allreduce(torch.ones(4 + (comm.rank == comm.size - 1)))
    elif kind == "dtype":
        comm.allreduce(x if comm.rank else x.double())
    return "no error"


def matched(comm):
    comm.debug = True
    x = comm.allreduce(torch.ones(3))
    g = comm.allgather(torch.ones(comm.rank + 1, 2))  # dim 0 may differ in debug mode too
    comm.barrier()
    sub = comm.split(0)
    return x.tolist(), tuple(g.shape), sub.size


@pytest.mark.parametrize("backend,nprocs", [("mpi", 2), ("torch", 2), ("mpi", 3)])
def test_debug_mode_names_both_ranks_and_call_sites(ranks, backend, nprocs):
    pool = ranks(backend, nprocs)
    for kind, words in (
        ("op", ("allreduce", "broadcast")),
        ("shape", ("(4,)", "(5,)")),
        ("dtype", ("float32", "float64")),
    ):
        results = pool.run(mismatched, kind, expect_errors=True)
        for error in results:
            assert isinstance(error, RankError) and error.type_name == "CollectiveMismatchError", error
            assert all(word in error.message for word in words), error.message
            assert "test_failures.py" in error.message and "in mismatched" in error.message
            for rank in range(nprocs):
                assert re.search(rf"\branks? (\d+, )*{rank}\b", error.message), (rank, error.message)
    # A mismatch is caught before the engine is touched: the same ranks keep working.
    for values, shape, sub_size in pool.run(matched):
        assert values == [float(nprocs)] * 3 and shape == (sum(range(1, nprocs + 1)), 2) and sub_size == nprocs


# ---------------------------------------------------------------- life cycle
def test_world_before_init_and_use_after_finalize():
    hpdl.finalize()
    with pytest.raises(hpdl.NotInitializedError, match="hpdl.init"):
        hpdl.world()
    comm = hpdl.init("self")
    assert hpdl.world() is comm and comm.backend == "self"
    assert hpdl.init("self") is comm  # idempotent
    hpdl.finalize()
    with pytest.raises(hpdl.NotInitializedError, match="finalize"):
        comm.allreduce(torch.ones(2))
    with pytest.raises(hpdl.NotInitializedError):
        hpdl.world()
    hpdl.finalize()  # twice is fine


def test_init_rejects_bad_arguments(monkeypatch):
    with pytest.raises(ValueError, match="unknown backend"):
        hpdl.init("carrier-pigeon")
    with pytest.raises(ValueError, match="positive"):
        hpdl.init("self", timeout=0)
    monkeypatch.setenv("HPDL_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="HPDL_TIMEOUT"):
        hpdl.init("self")


def test_self_backend_semantics():
    comm = SelfCommunicator(timeout=5, debug=True)
    x = np.arange(3.0)
    assert comm.allreduce(x, op="avg") is x and list(x) == [0.0, 1.0, 2.0]
    assert comm.allgather(torch.ones(2, 2)).shape == (2, 2)
    with pytest.raises(ValueError, match="out of range"):
        comm.send(torch.ones(1), 1)
    assert comm.split(None) is None and comm.split(3).size == 1
