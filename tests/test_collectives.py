"""Every collective, on every backend, for every dtype and size: one body, results checked here.

The same body runs on the `self` backend (in this process), on MPI
(`mpiexec -n K`) and on torch.distributed (gloo); the pytest process
compares every rank's result with what the collective must give.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from collective_data import ALL_DTYPES, HIERARCHICAL, LARGE, SHM_FORCED, SIZES, expected_reduce, make_input, ops_for

# Every message takes the shared-memory path (thresholds at zero), and on 4 ranks cut into two virtual
# nodes of 2, the hierarchical allreduce.
SHM = SHM_FORCED
GROUPS = [
    ("self", 1, None),
    ("mpi", 2, None),
    ("mpi", 3, None),
    ("torch", 2, None),
    ("torch", 3, None),
    ("mpi", 2, SHM),
    ("mpi", 3, SHM),
    ("mpi", 4, HIERARCHICAL),
]
NAMES = {None: "", id(SHM): "-shm", id(HIERARCHICAL): "-hier"}


@pytest.fixture(params=GROUPS, ids=[f"{b}-{k}{NAMES[env and id(env)]}" for b, k, env in GROUPS])
def group(request, ranks):
    backend, nprocs, env = request.param
    return ranks(backend, nprocs, env)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        return torch.allclose(a.double(), b.double(), rtol=1e-2 if a.element_size() == 2 else 1e-6)
    return torch.equal(a, b)


# ---------------------------------------------------------------- allreduce
def allreduce_all(comm):
    out = {}
    for dtype in ALL_DTYPES:
        for op in ops_for(dtype):
            for n in SIZES:
                x = make_input(comm.rank, n, dtype, op)
                returned = comm.allreduce(x, op=op)
                out[(str(dtype), op, n)] = (x, returned is x)
    return out


def test_allreduce_every_dtype_op_size(group):
    for result in group.run(allreduce_all):
        for (dtype_name, op, n), (value, same_object) in result.items():
            dtype = getattr(torch, dtype_name.replace("torch.", ""))
            assert same_object, "allreduce must work in place and return its argument"
            expected = expected_reduce(group.nprocs, n, dtype, op)
            assert _close(value, expected), (dtype_name, op, n, value[:8], expected[:8])


def allreduce_large(comm):
    x = make_input(comm.rank, LARGE, torch.float32)
    comm.allreduce(x, op="avg")
    return float(x.sum()), x[:5].tolist(), x[-5:].tolist()


def test_allreduce_large_buffer(group):
    expected = expected_reduce(group.nprocs, LARGE, torch.float32, "avg")
    for total, head, tail in group.run(allreduce_large, timeout=120):
        assert total == pytest.approx(float(expected.double().sum()), rel=1e-6)
        assert head == expected[:5].tolist() and tail == expected[-5:].tolist()


# ---------------------------------------------------------------- allgather
def allgather_uneven(comm):
    out = {}
    for dtype in ALL_DTYPES:
        for base in (0, 1, 5):
            rows = base + comm.rank  # dim 0 differs per rank (rank 0 may have none)
            x = make_input(comm.rank, rows * 3, dtype).reshape(rows, 3)
            out[(str(dtype), base)] = comm.allgather(x)
    hinted = comm.allgather(torch.full((2, 2), comm.rank), sizes=[2] * comm.size)
    scalar = comm.allgather(torch.tensor(float(comm.rank)))
    return out, hinted, scalar


def test_allgather_uneven_sizes(group):
    k = group.nprocs
    for out, hinted, scalar in group.run(allgather_uneven):
        for (dtype_name, base), value in out.items():
            dtype = getattr(torch, dtype_name.replace("torch.", ""))
            expected = torch.cat([make_input(r, (base + r) * 3, dtype).reshape(base + r, 3) for r in range(k)])
            assert torch.equal(value, expected), (dtype_name, base)
        assert torch.equal(hinted, torch.cat([torch.full((2, 2), r) for r in range(k)]))
        assert scalar.tolist() == [float(r) for r in range(k)]


def allgather_rows_differ(comm):
    """Rows of different lengths (no sizes: the ranks exchange them, and the rows' lengths), then a barrier, whose
    agreement check sees that the ranks called the allgather differently: what each call raised, or None."""
    from hpdl.errors import CollectiveMismatchError

    every = comm.check_every
    # the periodic check falls where the pool's earlier calls put it: not at the allgather's own calls
    while every and any((comm._seq + k) % every == 0 for k in (1, 2)):
        comm.allreduce(torch.ones(1))
    said = []
    for call in (lambda: comm.allgather(torch.zeros(2, 3 + comm.rank)), comm.barrier):
        try:
            call()
            said.append(None)
        except (ValueError, CollectiveMismatchError) as exc:
            said.append(f"{type(exc).__name__}: {exc}")
    return (*said, comm.check_every)


def test_allgather_of_rows_that_differ_raises_on_every_rank(group):
    for gathered, checked, every in group.run(allgather_rows_differ):
        if group.nprocs == 1:  # one rank cannot differ from itself
            assert gathered is None and checked is None
            continue
        assert gathered is not None and gathered.startswith("ValueError") and "only dim 0 may differ" in gathered
        if every:  # (MPI's default; gloo compares sizes itself and runs no check)
            assert checked is not None and checked.startswith("CollectiveMismatchError") and "allgather" in checked
        else:
            assert checked is None


def allgather_large(comm):
    x = torch.full((LARGE // comm.size,), float(comm.rank))
    y = comm.allgather(x)
    return y.shape[0], [float(y[i * (LARGE // comm.size)]) for i in range(comm.size)]


def test_allgather_large_buffer(group):
    k = group.nprocs
    for n, firsts in group.run(allgather_large, timeout=120):
        assert n == (LARGE // k) * k and firsts == [float(r) for r in range(k)]


# ---------------------------------------------------------------- reduce_scatter, broadcast, alltoall
def reduce_scatter_all(comm):
    out = {}
    for dtype in ALL_DTYPES:
        if dtype == torch.bool:
            continue
        for op in ops_for(dtype):
            for rows_per_rank in (0, 1, 4):
                x = make_input(comm.rank, comm.size * rows_per_rank * 2, dtype, op).reshape(-1, 2)
                out[(str(dtype), op, rows_per_rank)] = comm.reduce_scatter(x, op=op)
    return out


def test_reduce_scatter(group):
    k = group.nprocs
    for rank, out in enumerate(group.run(reduce_scatter_all)):
        for (dtype_name, op, m), value in out.items():
            dtype = getattr(torch, dtype_name.replace("torch.", ""))
            full = expected_reduce(k, k * m * 2, dtype, op).reshape(-1, 2)
            assert _close(value, full[rank * m : (rank + 1) * m]), (dtype_name, op, m)


def reduce_scatter_mid_sizes(comm):
    """Inputs of 768 KiB, in the window where MPICH's nonblocking reduce_scatter runs another MPI call
    (mpi_calls.counted_reduce_scatter), blocking and async: (dtype, op, async) of every wrong result."""
    wrong = []
    for dtype in ALL_DTYPES:
        if dtype == torch.bool:
            continue
        wire = 4 if dtype in (torch.float16, torch.bfloat16) else torch.empty(0, dtype=dtype).element_size()
        rows = (768 * 1024) // (comm.size * 2 * wire)
        for op in ops_for(dtype):
            x = make_input(comm.rank, comm.size * rows * 2, dtype, op).reshape(-1, 2)
            full = expected_reduce(comm.size, comm.size * rows * 2, dtype, op).reshape(-1, 2)
            mine = full[comm.rank * rows : (comm.rank + 1) * rows]
            for async_op in (False, True):
                out = torch.full((rows, 2), -7, dtype=dtype)
                done = comm.reduce_scatter(x, op=op, out=out, async_op=async_op)
                if async_op:
                    done.wait()
                if not _close(out, mine):
                    wrong.append((str(dtype), op, async_op))
    return wrong


@pytest.mark.parametrize("nprocs, env", [(2, None), (3, None), (2, SHM)], ids=["mpi-2", "mpi-3", "mpi-2-shm"])
def test_reduce_scatter_at_mid_sizes(ranks, nprocs, env):
    assert ranks("mpi", nprocs, env).run(reduce_scatter_mid_sizes) == [[]] * nprocs


def broadcast_all(comm):
    out = {}
    for dtype in ALL_DTYPES:
        for n in SIZES:
            for root in sorted({0, comm.size - 1}):
                x = make_input(comm.rank, n, dtype)
                out[(str(dtype), n, root)] = comm.broadcast(x, root=root)
    return out


def test_broadcast(group):
    for out in group.run(broadcast_all):
        for (dtype_name, n, root), value in out.items():
            dtype = getattr(torch, dtype_name.replace("torch.", ""))
            assert torch.equal(value, make_input(root, n, dtype)), (dtype_name, n, root)


def alltoall_all(comm):
    return {m: comm.alltoall(torch.arange(comm.size * m) + 100 * comm.rank) for m in (0, 1, 3)}


def test_alltoall(group):
    k = group.nprocs
    for rank, out in enumerate(group.run(alltoall_all)):
        for m, value in out.items():
            expected = torch.cat([torch.arange(rank * m, (rank + 1) * m) + 100 * src for src in range(k)])
            assert torch.equal(value, expected), m


# ---------------------------------------------------------------- point-to-point
def ring_exchange(comm):
    if comm.size == 1:
        return None
    got = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        for n in (0, 5, LARGE // 4):
            right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
            outgoing = make_input(comm.rank, n, dtype)
            incoming = torch.empty_like(outgoing)
            sending = comm.send(outgoing, right, tag=7, async_op=True)
            comm.recv(incoming, left, tag=7)
            sending.wait()
            got[(str(dtype), n)] = bool(torch.equal(incoming, make_input(left, n, dtype)))
    # src=None: rank 0 takes every other rank's message in arrival order; the work names the sender
    if comm.rank == 0:
        senders = []
        for _ in range(comm.size - 1):
            t = torch.empty(3)
            work = comm.recv(t, None, tag=9, async_op=True)
            work.wait()
            senders.append((work.source, t.tolist()))
        got["any source"] = sorted(senders) == [(r, [10.0 * r] * 3) for r in range(1, comm.size)]
    else:
        comm.send(torch.full((3,), 10.0 * comm.rank), 0, tag=9)
    return got


def test_send_recv_ring(group):
    for result in group.run(ring_exchange, timeout=120):
        if group.nprocs > 1:
            assert result and all(result.values()), result


# ---------------------------------------------------------------- async, numpy, objects
def async_many(comm):
    xs = [torch.full((100,), float(comm.rank + i)) for i in range(5)]
    works = [comm.allreduce(x, async_op=True) for x in xs]
    gathered = comm.allgather(torch.tensor([comm.rank]), async_op=True)
    scattered = comm.reduce_scatter(torch.ones(comm.size * 2), async_op=True)
    barrier = comm.barrier(async_op=True)
    results = [w.wait() for w in reversed(works)]
    barrier.wait()
    return (
        [r[0].item() for r in reversed(results)],
        gathered.wait().tolist(),
        scattered.wait().tolist(),
        works[0].is_completed(),
    )


def test_async_forms(group):
    k = group.nprocs
    for sums, gathered, scattered, completed in group.run(async_many):
        assert sums == [sum(float(r + i) for r in range(k)) for i in range(5)]
        assert gathered == list(range(k)) and scattered == [float(k)] * 2 and completed


def numpy_arrays(comm):
    a = np.arange(4, dtype=np.float64) * (comm.rank + 1)
    same = comm.allreduce(a, op="max") is a
    g = comm.allgather(np.full(2, comm.rank, dtype=np.int32))
    return a, same, g, type(g).__name__


def test_numpy_arrays_in_and_out(group):
    k = group.nprocs
    for a, same, g, kind in group.run(numpy_arrays):
        assert same and kind == "ndarray"
        np.testing.assert_array_equal(a, np.arange(4) * k)
        np.testing.assert_array_equal(g, np.repeat(np.arange(k, dtype=np.int32), 2))


def objects(comm):
    return comm.allgather_object({"rank": comm.rank, "name": "x" * comm.rank}), comm.broadcast_object(
        ["from root", comm.rank] if comm.rank == 0 else None
    )


def test_object_collectives(group):
    k = group.nprocs
    for gathered, broadcast in group.run(objects):
        assert gathered == [{"rank": r, "name": "x" * r} for r in range(k)]
        assert broadcast == ["from root", 0]


# ---------------------------------------------------------------- fusion
def coalesced(comm):
    generator = torch.Generator().manual_seed(0)
    shapes = [(int(torch.randint(1, 300, (1,), generator=generator)),) for _ in range(200)]
    dtypes = [torch.float32, torch.float64, torch.int64, torch.bfloat16]
    tensors = [make_input(comm.rank, s[0], dtypes[i % 4]) for i, s in enumerate(shapes)]
    returned = comm.allreduce_coalesced(tensors, bucket_mb=0.002)  # force many buckets
    averaged = comm.allreduce_coalesced([make_input(comm.rank, 10, torch.float32)], op="avg", async_op=True).wait()
    return [(s[0], str(dtypes[i % 4])) for i, s in enumerate(shapes)], tensors, returned[0] is tensors[0], averaged


def test_allreduce_coalesced(group):
    k = group.nprocs
    for meta, tensors, same, averaged in group.run(coalesced):
        assert same
        for (n, dtype_name), value in zip(meta, tensors):
            dtype = getattr(torch, dtype_name.replace("torch.", ""))
            assert _close(value, expected_reduce(k, n, dtype, "sum"))
        assert _close(averaged[0], expected_reduce(k, 10, torch.float32, "avg"))


def coalesced_again(comm):
    """The same list reduced step after step, changed between steps as training code changes it."""
    results = []
    for bucket_mb in (None, 0.004):  # one bucket; several
        grads = [torch.full((n,), float(comm.rank + 1)) for n in (3, 1000, 5, 2000)]
        for step in range(7):
            if step == 2:
                grads[1].resize_(600)  # shrunk in place (same object, same address)
            if step == 3:
                grads[1].resize_(800)  # grown again within its memory: more elements than last time
            if step == 4:
                grads[2] = torch.full((5,), float(comm.rank + 1), dtype=torch.float64)  # a new object, another dtype
            if step == 5:
                grads[3].set_(torch.full((7,), float(comm.rank + 1)))  # the same object on new memory
            comm.allreduce_coalesced(grads, bucket_mb=bucket_mb)
            results.append([(str(g.dtype), g.tolist()) for g in grads])
            for g in grads:
                g.fill_(comm.rank + 1)
    return results


def test_allreduce_coalesced_again_and_again(group):
    k = group.nprocs
    total = k * (k + 1) / 2
    for results in group.run(coalesced_again):
        for step, tensors in enumerate(results):
            step %= 7
            sizes = [3, [1000, 1000, 600, 800, 800, 800, 800][step], 5, 7 if step >= 5 else 2000]
            dtypes = ["torch.float32"] * 2 + ["torch.float64" if step >= 4 else "torch.float32", "torch.float32"]
            assert [(d, [total] * n) for d, n in zip(dtypes, sizes)] == tensors, step


# ---------------------------------------------------------------- sub-communicators
def splits(comm):
    sub = comm.split(comm.rank % 2, key=-comm.rank)  # reversed order inside each colour
    total = sub.allreduce(torch.tensor([comm.rank]))
    members = sub.allgather(torch.tensor([comm.rank]))
    nested = sub.split(0, key=sub.rank)
    again = nested.allreduce(torch.tensor([1]))
    none = comm.split(None if comm.rank == 0 else 1)
    rest = None if none is None else none.allgather(torch.tensor([comm.rank])).tolist()
    # Block order follows the sub-communicator's ranks (set by the keys), not the world's.
    scattered = sub.reduce_scatter(torch.arange(sub.size * 2.0) * (comm.rank + 1))
    exchanged = sub.alltoall(torch.arange(sub.size) + 100 * comm.rank)
    return (
        sub.rank,
        sub.size,
        total.item(),
        members.tolist(),
        again.item(),
        rest,
        scattered.tolist(),
        exchanged.tolist(),
    )


def test_split(group):
    k = group.nprocs
    for rank, result in enumerate(group.run(splits)):
        sub_rank, sub_size, total, members, again, rest, scattered, exchanged = result
        mine = sorted((r for r in range(k) if r % 2 == rank % 2), reverse=True)
        assert members == mine and sub_rank == mine.index(rank) and sub_size == len(mine)
        assert total == sum(mine) and again == len(mine)
        assert rest == (None if rank == 0 else list(range(1, k)))
        weight = sum(r + 1 for r in mine)
        assert scattered == [float((2 * sub_rank + i) * weight) for i in range(2)]
        assert exchanged == [sub_rank + 100 * member for member in mine]


# ---------------------------------------------------------------- caller's output buffers
def into_out(comm):
    k, r = comm.size, comm.rank
    gathered = torch.empty(2 * k, 3)
    same_g = comm.allgather(torch.full((2, 3), float(r)), out=gathered) is gathered
    uneven = torch.empty(sum(range(1, k + 1)), dtype=torch.int64)
    comm.allgather(torch.full((r + 1,), r), sizes=list(range(1, k + 1)), out=uneven)
    scattered = torch.empty(2, dtype=torch.bfloat16)
    same_s = comm.reduce_scatter(torch.ones(2 * k, dtype=torch.bfloat16), out=scattered, op="avg") is scattered
    exchanged = np.empty(k, dtype=np.int64)
    same_a = comm.alltoall(np.arange(k) + 10 * r, out=exchanged) is exchanged
    work = comm.allgather(torch.tensor([r]), out=torch.empty(k, dtype=torch.int64), async_op=True)
    in_place = torch.full((2 * k, 3), -1.0)  # each rank's input is its own block of out (FSDP's gather)
    in_place[2 * r : 2 * r + 2] = float(r)
    comm.allgather(in_place[2 * r : 2 * r + 2], out=in_place)
    first = sum(range(1, r + 1))
    in_place_uneven = torch.full((sum(range(1, k + 1)),), -1, dtype=torch.int64)
    in_place_uneven[first : first + r + 1] = r
    comm.allgather(in_place_uneven[first : first + r + 1], sizes=list(range(1, k + 1)), out=in_place_uneven)
    errors = []
    for bad in (torch.empty(2 * k + 1, 3), torch.empty(2 * k, 3, dtype=torch.float64), torch.empty(2 * k, 3).t()):
        try:
            comm.allgather(torch.ones(2, 3), out=bad)
        except ValueError as exc:
            errors.append(str(exc))
    in_place_results = (in_place, in_place_uneven)
    return gathered, same_g, uneven, scattered, same_s, exchanged, same_a, work.wait(), in_place_results, errors


def test_results_into_caller_buffers(group):
    k = group.nprocs
    for r, result in enumerate(group.run(into_out)):
        gathered, same_g, uneven, scattered, same_s, exchanged, same_a, waited, (in_place, in_place_uneven), errors = (
            result
        )
        assert same_g and same_s and same_a
        assert torch.equal(gathered, torch.cat([torch.full((2, 3), float(s)) for s in range(k)]))
        assert torch.equal(in_place, gathered)
        assert torch.equal(uneven, torch.cat([torch.full((s + 1,), s) for s in range(k)]))
        assert torch.equal(in_place_uneven, uneven)
        assert scattered.tolist() == [1.0, 1.0]
        np.testing.assert_array_equal(exchanged, r + 10 * np.arange(k))
        assert waited.tolist() == list(range(k))
        assert len(errors) == 3 and "shape" in errors[0] and "dtype" in errors[1] and "contiguous" in errors[2]


def uneven_split_history(comm):
    """Splits after splits that only some ranks joined (colour None) still agree on every group."""
    first = comm.split(0 if comm.rank < 2 else None)
    second = comm.split(0)
    third = comm.split(comm.rank % 2)
    return (
        None if first is None else first.allreduce(torch.tensor([1])).item(),
        second.allreduce(torch.tensor([1])).item(),
        third.allreduce(torch.tensor([comm.rank])).item(),
    )


def test_split_after_splits_some_ranks_skipped(ranks):
    for backend in ("mpi", "torch"):
        for rank, (first, second, third) in enumerate(ranks(backend, 3).run(uneven_split_history)):
            assert first == (2 if rank < 2 else None) and second == 3
            assert third == sum(r for r in range(3) if r % 2 == rank % 2)


def async_coalesced_tested_first(comm):
    """A handle tested before it is waited on finishes each part once (no second division for avg)."""
    small, large = torch.full((1,), float(comm.rank + 1)), torch.full((1 << 21,), float(comm.rank + 1))
    work = comm.allreduce_coalesced([small, large], op="avg", bucket_mb=1, async_op=True)
    work.is_completed()
    work.wait()
    return small.item(), large[-1].item()


def half_reduce_scatter_large(comm):
    """16-bit reduce_scatter through float32 temporaries that must live until MPI is done with them."""
    x = torch.full((comm.size * (1 << 21),), float(comm.rank + 1), dtype=torch.bfloat16)
    out = comm.reduce_scatter(x)
    return out.float().unique().tolist()


def test_async_and_temporary_buffers_regressions(ranks):
    k = 2
    mean = sum(range(1, k + 1)) / k
    for backend in ("mpi", "torch"):
        assert ranks(backend, k).run(async_coalesced_tested_first) == [(mean, mean)] * k
    assert ranks("mpi", k).run(half_reduce_scatter_large) == [[float(sum(range(1, k + 1)))]] * k
