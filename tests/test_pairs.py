"""Two-rank communicators send their collectives as messages (hpdl/comm/pairs.py): the same results as MPI's
collectives, on every path that can start one.

Each body runs the same calls in pools whose collectives travel as messages (the default on two ranks, compiled
and through mpi4py, receiving at once or after a matched probe) and in one where they do not
(HPDL_PAIR_BYTES=0): blocking, async, through the general path (16-bit floats, no `out`), an allgather in
place, broadcasts from both roots, at sizes from 0 elements to past MPI's eager limit; the results must be
equal bit for bit."""

from __future__ import annotations

import pytest
import torch

from collective_data import ops_for

SIZES = (0, 1, 7, 1000, 300_000)
DTYPES = (torch.float32, torch.float64, torch.int32, torch.float16, torch.bool)
MESSAGES = {
    "compiled": {},
    "mpi4py": {"HPDL_COMPILED": "0"},
    "compiled, probing first": {"HPDL_PROBE_FIRST": "1"},
    "mpi4py, probing first": {"HPDL_COMPILED": "0", "HPDL_PROBE_FIRST": "1"},
}
COLLECTIVES = {"HPDL_PAIR_BYTES": "0"}


def values(rank, n, dtype):
    x = (torch.arange(n, dtype=torch.float64) * 0.37 + rank * 1.5).sin() * 10
    return x > 0 if dtype == torch.bool else x.to(dtype)


def every_collective(comm):
    """{(call, dtype, n): result} for one rank; async calls are waited for at the end, out of order."""
    rank, size = comm.rank, comm.size
    out, handles = {}, []
    for dtype in DTYPES:
        for n in SIZES:
            mine = values(rank, n, dtype)
            ops = ("max", "min") if dtype == torch.bool else ops_for(dtype)
            for op in ops:
                out["allreduce", op, dtype, n] = comm.allreduce(mine.clone(), op)
            handles.append((("allreduce async", dtype, n), comm.allreduce(mine.clone(), "max", async_op=True)))
            whole = torch.zeros(n * size, dtype=dtype)
            out["allgather", dtype, n] = comm.allgather(mine, sizes=[n] * size, out=whole).clone()
            whole = torch.zeros(n * size, dtype=dtype)
            whole[rank * n : (rank + 1) * n] = mine
            out["allgather in place", dtype, n] = comm.allgather(
                whole[rank * n : (rank + 1) * n], sizes=[n] * size, out=whole
            )
            out["allgather new", dtype, n] = comm.allgather(mine, sizes=[n] * size)
            out["allgather no sizes", dtype, n] = comm.allgather(mine, out=torch.zeros(n * size, dtype=dtype))
            if dtype != torch.bool:
                both = torch.cat([mine, mine * 2])
                out["reduce_scatter", dtype, n] = comm.reduce_scatter(both, "sum", out=torch.zeros(n, dtype=dtype))
                out["reduce_scatter new", dtype, n] = comm.reduce_scatter(both.clone(), "max")
                handles.append((("reduce_scatter async", dtype, n), comm.reduce_scatter(both.clone(), async_op=True)))
            for root in range(size):
                out["broadcast", root, dtype, n] = comm.broadcast(mine.clone(), root=root)
    for key, handle in reversed(handles):
        out[key] = handle.wait()
    return out


def test_messages_give_what_the_collectives_give(ranks):
    reference = ranks("mpi", 2, env=COLLECTIVES).run(every_collective)
    for name, env in MESSAGES.items():
        got = ranks("mpi", 2, env=env).run(every_collective)
        for rank in range(2):
            assert got[rank].keys() == reference[rank].keys()
            for key, expected in reference[rank].items():
                assert got[rank][key].dtype == expected.dtype, (name, rank, key)
                assert torch.equal(got[rank][key], expected), (name, rank, key)


def past_the_thresholds(comm):
    """An ordinary reduce_scatter and allgather larger than the shared-memory path's built-in thresholds, then the
    same reduce_scatter from a shared buffer: (the engine's steps in each, the thresholds in force, the results)."""
    from hpdl.comm import shm

    shared = comm.shared_buffer(shm.DEFAULT_THRESHOLDS["reduce_scatter"][1] // 4)  # (the engine runs, counting)
    n = shared.numel()  # float32 elements of input
    before = comm._node._phase
    block = comm.reduce_scatter(values(comm.rank, n, torch.float32), out=torch.empty(n // 2))
    gathered = comm.allgather(block, sizes=[n // 2] * 2)
    steps = comm._node._phase - before
    shared.copy_(values(comm.rank, n, torch.float32))
    before = comm._node._phase
    from_shared = comm.reduce_scatter(shared, out=torch.empty(n // 2))
    shared_steps = comm._node._phase - before
    thresholds = comm._shm_thresholds["reduce_scatter"], comm._shm_thresholds["allgather"]
    return steps, shared_steps, *thresholds, gathered, torch.equal(from_shared, block)


def test_two_ranks_send_large_reduce_scatters_and_allgathers_as_messages(ranks):
    """Messages beat the shared-memory engine there on two ranks (shm.thresholds): the engine takes no step but the
    agreement on shared buffers, and the sums are one float32 addition per element, as torch's. A reduce_scatter
    of shared buffers on both ranks takes the engine (it sums both blocks where they lie, in one pass): the same
    bits."""
    from hpdl.comm import shm

    n = shm.DEFAULT_THRESHOLDS["reduce_scatter"][1] // 4
    expected = values(0, n, torch.float32) + values(1, n, torch.float32)
    for steps, shared_steps, reduce_scatter, allgather, gathered, same in ranks("mpi", 2).run(past_the_thresholds):
        assert steps == 1  # the ranks agree that their tensors are not in shared buffers; then messages
        assert reduce_scatter == (shm.TWO_RANKS_SHARED["reduce_scatter"], shm.NEVER) and n * 4 >= reduce_scatter[0]
        assert allgather == (shm.NEVER, shm.NEVER)
        assert torch.equal(gathered, expected)
        assert shared_steps > 2 and same  # (the agreement on shared buffers, then two meetings a piece)


def pair_state(comm):
    child = comm.split(0, comm.rank) if comm.size > 2 else None
    pairs = comm.split(comm.rank // 2, comm.rank)
    return {
        "pair": type(comm._pair).__name__ if comm._pair is not None else None,
        "below": [comm._pair_allreduce_below, comm._pair_allgather_below, comm._pair_broadcast_below],
        "sub-communicator of 2": type(pairs._pair).__name__ if pairs.size == 2 else "n/a",
        "whole": child is not None and child._pair is None,
    }


@pytest.mark.parametrize("env", [{}, {"HPDL_COMPILED": "0"}, COLLECTIVES], ids=["compiled", "mpi4py", "off"])
def test_two_rank_communicators_have_a_pair(ranks, env):
    for state in ranks("mpi", 2, env=env).run(pair_state):
        if env is COLLECTIVES:
            assert state["pair"] is None and state["below"] == [0, 0, 0]
            continue
        assert state["pair"] == "Pair"
        assert state["below"][0] == 32 * 1024  # allreduce: messages below 32 KiB, MPI's collective from there
        assert state["below"][1] >= 1 << 20 and state["below"][2] >= 1 << 20
        assert state["sub-communicator of 2"] == "Pair"


def test_three_ranks_use_the_collectives_and_their_pairs_the_messages(ranks):
    for rank, state in enumerate(ranks("mpi", 3).run(pair_state)):
        assert state["pair"] is None and state["whole"]
        assert state["sub-communicator of 2"] == ("Pair" if rank < 2 else "n/a")  # ranks 0 and 1; rank 2 alone


def mixed_waits(comm):
    """Rank 0 starts its calls async and waits later; rank 1 blocks: the messages still meet in order."""
    t = [torch.full((5,), float(comm.rank + k)) for k in range(4)]
    if comm.rank == 0:
        handles = [comm.allreduce(t[0], async_op=True), comm.broadcast(t[1], root=1, async_op=True)]
        handles.append(comm.allreduce(t[2], "max", async_op=True))
        for handle in handles:
            handle.wait()
    else:
        comm.allreduce(t[0])
        comm.broadcast(t[1], root=1)
        comm.allreduce(t[2], "max")
    return [x[0].item() for x in t[:3]]


def test_async_and_blocking_calls_meet(ranks):
    for env in MESSAGES.values():
        assert ranks("mpi", 2, env=env).run(mixed_waits) == [[1.0, 2.0, 3.0]] * 2


def allreduce_on_many(comm):
    """Exact values (small integers: any order of summation gives the same) and random floats (the ranks must hold
    the same bits, whatever the order), blocking and async, every op."""
    rank, out = comm.rank, {}
    for dtype in (torch.float32, torch.float64, torch.int64, torch.float16):
        for n in (0, 1, 7, 1000, 3000):
            mine = ((torch.arange(n) * 7 + rank * 3) % 11).to(dtype)
            for op in ops_for(dtype):
                out["allreduce", op, dtype, n] = comm.allreduce(mine.clone(), op)
            out["async", dtype, n] = comm.allreduce(mine.clone(), async_op=True).wait()
    noise = torch.randn(777, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    out["floats"] = comm.allreduce(noise)
    return out


def test_an_allreduce_on_four_ranks_travels_as_messages_and_equals_the_collective(ranks):
    """Recursive doubling (pairs.py) on 4 ranks: the collective's results on exact values, and the same bits on
    every rank where the order of a float sum matters."""
    reference = ranks("mpi", 4, env=COLLECTIVES).run(allreduce_on_many)
    # (two of the four ways: each implementation and each receive mode once; a pool of 4 ranks takes ~8 s on 2
    # cores, and the two-rank tests above run all four)
    for env in (MESSAGES["compiled"], MESSAGES["mpi4py, probing first"]):
        got = ranks("mpi", 4, env=env).run(allreduce_on_many)
        for rank in range(4):
            for key, expected in reference[rank].items():
                if key == "floats":
                    assert torch.equal(got[rank][key], got[0][key])  # every rank the same bits
                    assert torch.allclose(got[rank][key], expected, rtol=0, atol=1e-12)
                else:
                    assert torch.equal(got[rank][key], expected), (env, rank, key)


def four_rank_state(comm):
    pairs = comm.split(comm.rank // 2, comm.rank)
    below = [comm._pair_allreduce_below, comm._pair_allgather_below, comm._pair_reduce_scatter_below]
    return type(comm._pair).__name__, below, type(pairs._pair).__name__


def test_four_ranks_take_the_allreduce_alone_as_messages(ranks):
    for name, below, of_two in ranks("mpi", 4).run(four_rank_state):
        assert name == "Pair" and below == [16 * 1024, 0, 0] and of_two == "Pair"
