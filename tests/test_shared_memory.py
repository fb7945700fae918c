"""The shared-memory path on MPI: zero-copy buffers, mixed callers, stress, fallbacks and failures.

The whole collective suite (test_collectives.py) already runs through the
shared-memory and hierarchical paths with their thresholds at zero; this
file covers what only this path has.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time

import pytest
import torch

from collective_data import HIERARCHICAL, expected_reduce, make_input, ops_for
from collective_data import SHM_FORCED as FORCED
from hpdl.runtime.spawn import mpiexec_argv


def zero_copy(comm, mixed):
    """Collectives on tensors that live in shared windows (or, with `mixed`, only on even ranks)."""
    out = {}
    shared = mixed is False or comm.rank % 2 == 0
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for n in (comm.size * 3, comm.size * 13_333):
            values = make_input(comm.rank, n, dtype)
            window = comm.shared_buffer(n, dtype)  # collective: every rank makes one
            x = window if shared else torch.empty(n, dtype=dtype)
            x.copy_(values)
            out[("allreduce", str(dtype), n)] = comm.allreduce(x).clone()
            x.copy_(values)
            scattered = comm.reduce_scatter(x)
            out[("reduce_scatter", str(dtype), n)] = scattered
            x.copy_(values)
            out[("allgather", str(dtype), n)] = comm.allgather(x, sizes=[n] * comm.size)
            out[("broadcast", str(dtype), n)] = comm.broadcast(x, root=comm.size - 1).clone()
    return comm.shm_status, out


@pytest.mark.parametrize("nprocs,mixed", [(2, False), (3, True)])
def test_shared_buffers_zero_copy_and_mixed(ranks, nprocs, mixed):
    results = ranks("mpi", nprocs, FORCED).run(zero_copy, mixed)
    for rank, (status, out) in enumerate(results):
        assert status.startswith("on:"), status
        for (op, dtype_name, n), value in out.items():
            dtype = getattr(torch, dtype_name.replace("torch.", ""))
            full = expected_reduce(nprocs, n, dtype, "sum")
            if op == "allreduce":
                expected = full
            elif op == "reduce_scatter":
                expected = full[rank * n // nprocs : (rank + 1) * n // nprocs]
            elif op == "allgather":
                expected = torch.cat([make_input(r, n, dtype) for r in range(nprocs)])
            else:
                expected = make_input(nprocs - 1, n, dtype)
            assert torch.equal(value, expected), (op, dtype_name, n)


def stress(comm, seed, rounds):
    """Back-to-back and overlapping asynchronous collectives with random sizes and kinds, in one order."""
    rng = random.Random(seed)  # the same sequence on every rank
    checks = 0
    for _ in range(rounds):
        kind = rng.choice(["allreduce", "async-pair", "reduce_scatter", "allgather", "broadcast", "shared"])
        n = rng.choice([1, 7, 1000, 20_000, 70_000]) * comm.size
        x = torch.full((n,), float(comm.rank + 1))
        total = comm.size * (comm.size + 1) / 2
        if kind == "allreduce":
            ok = bool((comm.allreduce(x) == total).all())
        elif kind == "async-pair":
            y = torch.full((n // comm.size,), 2.0 * (comm.rank + 1))
            first, second = comm.allreduce(x, async_op=True), comm.allreduce(y, op="max", async_op=True)
            ok = bool((second.wait() == 2.0 * comm.size).all()) and bool((first.wait() == total).all())
        elif kind == "reduce_scatter":
            ok = bool((comm.reduce_scatter(x) == total).all())
        elif kind == "allgather":
            g = comm.allgather(x[: n // comm.size])
            ok = g.view(comm.size, -1)[:, 0].tolist() == [float(r + 1) for r in range(comm.size)]
        elif kind == "broadcast":
            root = rng.randrange(comm.size)
            ok = bool((comm.broadcast(x, root=root) == root + 1).all())
        else:
            z = comm.shared_buffer(n)
            z.fill_(comm.rank + 1)
            ok = bool((comm.allreduce(z) == total).all())
        if not ok:
            return f"wrong result in round {checks} ({kind}, {n} elements)"
        checks += 1
    return checks


@pytest.mark.parametrize("nprocs,env", [(2, FORCED), (4, HIERARCHICAL)])
def test_stress_random_sizes_and_orders(ranks, nprocs, env):
    started = time.monotonic()
    results = ranks("mpi", nprocs, env).run(stress, 7, 60, timeout=120)
    assert results == [60] * nprocs
    assert time.monotonic() - started < 120


def packed_buckets(comm):
    """Fusion buckets reduced straight from and into their tensors: pieces of the staging segment that cut
    tensors in two, several dtypes and ops, an average; counts the flat buffers packed on the way."""
    from hpdl.comm import fusion

    packed = []
    fill = fusion.Bucket.fill
    fusion.Bucket.fill = lambda bucket: (packed.append(len(bucket.targets)), fill(bucket))[-1]
    try:
        out = {}
        sizes = (1, 16_001, 7, 33_333, 0, 5)  # 50 KB .. 130 KB pieces of 64 KB: boundaries inside tensors
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.bool):
            for op in ops_for(dtype):
                tensors = [make_input(comm.rank, n, dtype, op) for n in sizes]
                returned = comm.allreduce_coalesced(tensors, op)
                out[(str(dtype), op)] = (returned[0] is tensors[0], tensors)
        counted = list(packed)
        # A tensor given twice, and overlapping views, read before any piece is written back (found in review:
        # they were summed twice once a bucket spanned two pieces).
        x = make_input(comm.rank, 40_000, torch.float32)
        whole = make_input(comm.rank, 50_000, torch.float32)
        comm.allreduce_coalesced([x, x, whole[:30_000], whole[20_000:]])
        out["shared memory"] = (x, whole)
        # The same call where one rank's tensors take the flat buffer (autograd tracks them) and the others' do
        # not: an average divides each slice once (found in review: rank 0's slices twice, rank 1's never).
        mixed = [make_input(comm.rank, n, torch.float32, "avg") for n in (30_000, 40_000)]
        with torch.no_grad():
            for t in mixed:
                t.requires_grad_(comm.rank == 1)
            comm.allreduce_coalesced(mixed, "avg")
        out["avg, mixed"] = [t.detach() for t in mixed]
    finally:
        fusion.Bucket.fill = fill
    return out, counted


@pytest.mark.parametrize("nprocs,env", [(3, FORCED), (2, dict(FORCED, HPDL_COMPILED="0")), (4, HIERARCHICAL)])
def test_fusion_buckets_reduced_straight_from_their_tensors(ranks, nprocs, env):
    compiled = env.get("HPDL_COMPILED") != "0"
    for out, packed in ranks("mpi", nprocs, env).run(packed_buckets):
        x, whole = out.pop("shared memory")
        assert torch.equal(x, expected_reduce(nprocs, 40_000, torch.float32, "sum"))
        assert torch.equal(whole, expected_reduce(nprocs, 50_000, torch.float32, "sum"))
        for n, value in zip((30_000, 40_000), out.pop("avg, mixed")):
            assert torch.allclose(value, expected_reduce(nprocs, n, torch.float32, "avg"))
        for (dtype_name, op), (same, tensors) in out.items():
            dtype = getattr(torch, dtype_name.replace("torch.", ""))
            assert same
            for n, value in zip((1, 16_001, 7, 33_333, 0, 5), tensors):
                expected = expected_reduce(nprocs, n, dtype, op)
                if op == "avg":  # a division: rounded once here, twice (float64, then dtype) in the expectation
                    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-6
                    assert torch.allclose(value.double(), expected.double(), rtol=tolerance), (dtype_name, n)
                else:
                    assert torch.equal(value, expected), (dtype_name, op, n)
        # compiled: no bucket of several tensors is packed into a flat buffer; not compiled, each one is
        assert (max(packed, default=1) == 1) if compiled else (min(packed) == len([1, 16_001, 7, 33_333, 0, 5]))


def float_sums_both_routes(comm):
    """Random float sums and averages through the compiled in-place reduction and through torch's (the same
    calls on the same inputs): plain tensors, fusion buckets, tensors in shared buffers (on every rank, on some)
    and reduce-scatters (of an ordinary tensor, of shared buffers), in pieces that cut tensors:
    (the compiled reductions made, the results of each route)."""
    from hpdl.comm import fusion

    calls = []
    compiled_reduce, summed_in_place = fusion.reduce_range, fusion.summed_in_place
    fusion.reduce_range = lambda *args, **kwargs: (calls.append(args[1]), compiled_reduce(*args, **kwargs))[-1]
    results = {}
    try:
        for route in ("compiled", "torch"):
            if route == "torch":
                fusion.summed_in_place = lambda dtype: False
            generator = torch.Generator().manual_seed(comm.rank)
            for dtype in (torch.float32, torch.float64):
                for op in ("sum", "avg"):
                    plain = torch.randn(50_001, generator=generator, dtype=dtype)
                    comm.allreduce(plain, op)
                    bucket = [torch.randn(n, generator=generator, dtype=dtype) for n in (3, 20_000, 1, 17_000)]
                    comm.allreduce_coalesced(bucket, op)
                    # in shared buffers on every rank (each writes its sums into the others'), and on even ranks
                    # only (the others staged)
                    shared = comm.shared_buffer(100_003, dtype)
                    shared.copy_(torch.randn(100_003, generator=generator, dtype=dtype))
                    comm.allreduce(shared, op)
                    window = comm.shared_buffer(100_003, dtype)
                    mixed = window if comm.rank % 2 == 0 else torch.empty(100_003, dtype=dtype)
                    mixed.copy_(torch.randn(100_003, generator=generator, dtype=dtype))
                    comm.allreduce(mixed, op)
                    blocks = torch.randn(comm.size * 30_001, generator=generator, dtype=dtype)
                    scattered = comm.reduce_scatter(blocks, op)
                    shared_blocks = comm.shared_buffer(comm.size * 30_001, dtype)  # read where they lie
                    shared_blocks.copy_(torch.randn(comm.size * 30_001, generator=generator, dtype=dtype))
                    scattered_shared = comm.reduce_scatter(shared_blocks, op)
                    reduced = [plain, *bucket, shared.clone(), mixed.clone()]
                    results[(route, str(dtype), op)] = [*reduced, scattered, scattered_shared]
    finally:
        fusion.reduce_range, fusion.summed_in_place = compiled_reduce, summed_in_place
    return len(calls), results


@pytest.mark.parametrize("nprocs", [2, 3])
def test_float_sums_reduced_in_place_equal_torch_reduction(ranks, nprocs):
    """The compiled reduction (each rank sums its slice where it lies, in the order torch's route adds) gives
    the same bits as the route through torch (on every rank, for an allreduce), and the sum of the inputs
    within rounding."""
    results = ranks("mpi", nprocs, FORCED).run(float_sums_both_routes)
    first = results[0][1]
    for calls, out in results:
        assert calls > 12  # 2 dtypes x 2 ops x (plain + bucket + reduce-scatter), several pieces each
        for (route, dtype_name, op), tensors in out.items():
            *reduced, scattered, scattered_shared = tensors
            for value, expected in zip(reduced, first[("compiled", dtype_name, op)]):
                assert torch.equal(value, expected), (route, dtype_name, op)  # every rank, both routes: same bits
            compiled = out[("compiled", dtype_name, op)]
            assert torch.equal(scattered, compiled[-2]), (route, dtype_name, op)
            assert torch.equal(scattered_shared, compiled[-1]), (route, dtype_name, op)
    inputs = [torch.Generator().manual_seed(r) for r in range(nprocs)]  # drawn in the ranks' order
    for dtype in (torch.float32, torch.float64):
        for op in ("sum", "avg"):
            sizes = (50_001, 3, 20_000, 1, 17_000, 100_003, 100_003, nprocs * 30_001, nprocs * 30_001)
            drawn = [[torch.randn(n, generator=g, dtype=dtype) for n in sizes] for g in inputs]
            for rank, (_, out) in enumerate(results):
                for i in (-2, -1):
                    exact = sum(rank_inputs[i].double() for rank_inputs in drawn) / (nprocs if op == "avg" else 1)
                    block = exact[rank * 30_001 : (rank + 1) * 30_001]
                    assert torch.allclose(out[("compiled", str(dtype), op)][i].double(), block, rtol=0, atol=1e-5)
            for i, value in enumerate(first[("compiled", str(dtype), op)][:-2]):
                exact = sum(rank_inputs[i].double() for rank_inputs in drawn) / (nprocs if op == "avg" else 1)
                tolerance = 1e-5 if dtype == torch.float32 else 1e-12
                assert torch.allclose(value.double(), exact, rtol=0, atol=tolerance), (str(dtype), op, i)


def status(comm):
    comm.allreduce(torch.ones(10))
    return comm.shm_status


def test_falls_back_to_plain_mpi_with_one_rank_per_node(ranks):
    statuses = ranks("mpi", 2, dict(FORCED, HPDL_RANKS_PER_NODE="1")).run(status)
    assert all(s.startswith("off: one rank on this node") for s in statuses), statuses


def test_switched_off_by_environment(ranks):
    statuses = ranks("mpi", 2, dict(FORCED, HPDL_SHM="0")).run(status)
    assert all(s.startswith("off (HPDL_SHM=0 or comm.shared_memory = False)") for s in statuses), statuses


def test_hierarchical_status_names_the_nodes(ranks):
    statuses = ranks("mpi", 4, HIERARCHICAL).run(status)
    assert all("hierarchical allreduce across 2 nodes" in s for s in statuses), statuses


def peer_buffers(comm):
    """Each rank's part of its shared buffer as every other rank maps it; a write into a node mate's buffer."""
    mine = comm.shared_buffer(8, torch.float64)
    mine.fill_(comm.rank)
    comm.fence_shared()
    comm.barrier()
    comm.fence_shared()
    seen = {r: comm.peer_buffer(mine[2:6], r) for r in range(comm.size)}
    mates = sorted(r for r, view in seen.items() if view is not None)
    values = {r: seen[r].tolist() for r in mates}
    mate = next(r for r in mates if r != comm.rank)
    comm.peer_buffer(mine[:1], mate).fill_(100 + comm.rank)  # the mate's element 0, written from here
    comm.fence_shared()
    comm.barrier()
    comm.fence_shared()
    ordinary = [comm.peer_buffer(torch.zeros(4, dtype=torch.float64), r) for r in mates]
    return mates, values, float(mine[0]), mine[1:].tolist(), ordinary


def test_peer_buffers_map_the_node_mates_shared_memory_and_no_one_elses(ranks):
    """`peer_buffer` (GEMS sums its copies' gradients through it): node mates only, read and write, same place."""
    results = ranks("mpi", 4, HIERARCHICAL).run(peer_buffers)  # 2 virtual nodes of 2 ranks
    for rank, (mates, values, first, rest, ordinary) in enumerate(results):
        assert len(mates) == 2 and rank in mates, mates
        assert all(results[mate][0] == mates for mate in mates)  # the same pairs seen from both sides
        assert values == {mate: [float(mate)] * 4 for mate in mates}
        (mate,) = set(mates) - {rank}
        assert first == 100 + mate and rest == [float(rank)] * 7  # only element 0 came from the mate
        assert ordinary == [None, None]  # a tensor outside the shared buffers has no counterpart


def peer_buffers_of_every_rank(comm):
    return [comm.peer_buffer(comm.shared_buffer(4, torch.float64), r) for r in range(comm.size)]


def test_no_peer_buffers_without_shared_memory(ranks):
    for backend, env in (("mpi", dict(FORCED, HPDL_SHM="0")), ("torch", None)):
        assert ranks(backend, 2, env).run(peer_buffers_of_every_rank) == [[None, None]] * 2, backend


def first_large_call_skipped(comm):
    """A new communicator's first collective above the thresholds starts the engine; the last rank skips it."""
    from hpdl.errors import CommTimeoutError

    sub = comm.split(0)
    sub.timeout = 2.0
    if comm.rank == comm.size - 1:
        return None
    try:
        sub.allreduce(torch.ones(1000))
    except CommTimeoutError as error:
        return str(error), error.op, error.missing
    return "returned"


def test_a_rank_that_skips_the_engines_first_call_is_named_in_that_calls_terms(ranks):
    """Found in review: the timeout was reported as the engine's start-up barrier, not as the call that starts it."""
    pool = ranks("mpi", 3, dict(FORCED, HPDL_TEST_POOL_FOR="a skipped start"))
    results = pool.run(first_large_call_skipped, timeout=60)
    pool.kill()  # the others' start-up barrier is still pending: the next user gets a fresh pool
    assert results[-1] is None
    for message, op, missing in results[:-1]:
        assert op == "allreduce" and missing == (2,), (op, missing, message)
        assert "starts the node's shared-memory engine at allreduce #" in message, message
        assert "Did not arrive: rank 2" in message, message


DIES = """
import os, sys, torch, hpdl
comm = hpdl.init(timeout=5)
print(f"started at {__import__('time').time():.3f}", flush=True)
x = torch.ones(100_000)
comm.allreduce(x)               # shared memory is up
if comm.rank == 1:
    os._exit(7)                 # dies between collectives, without a word
comm.allreduce(x)               # rank 0 waits at the shared-memory flags
"""


def test_rank_that_dies_mid_collective_ends_the_others_within_the_timeout(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(DIES)
    done = subprocess.run(
        [sys.executable, "-m", "hpdl.cli.main", "launch", "-n", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1", **FORCED),
    )
    ended = time.time()
    assert done.returncode != 0
    started = min(float(t) for t in re.findall(r"started at (\d+\.\d+)", done.stdout))  # after start-up
    assert ended - started < 30, done.stderr


def short_of_shared_memory(comm, available: int) -> tuple:
    """A new communicator's engine and shared buffer where /dev/shm is said to hold `available` bytes."""
    import warnings

    saved = os.environ.get("HPDL_SHM_MB")
    os.environ["HPDL_SHM_AVAILABLE_BYTES"] = str(available)
    os.environ["HPDL_SHM_MB"] = "32"  # the default (the pool's environment has a small one)
    try:
        sub = comm.split(0, comm.rank)
        t = torch.full((16 << 20,), float(comm.rank + 1))  # 64 MiB: above every threshold
        sub.allreduce(t)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            buffer = sub.shared_buffer(8 << 20)  # 32 MiB per rank
        buffer.fill_(comm.rank + 1.0)
        sub.allreduce(buffer)
        ordinary = sub.peer_buffer(buffer, 1 - comm.rank) is None
        out = sub.shm_status, t.unique().tolist(), buffer.unique().tolist(), ordinary, [str(w.message) for w in caught]
        sub.close()
        return out
    finally:
        del os.environ["HPDL_SHM_AVAILABLE_BYTES"]
        if saved is None:
            del os.environ["HPDL_SHM_MB"]
        else:
            os.environ["HPDL_SHM_MB"] = saved


def test_a_small_dev_shm_shrinks_the_engine_and_keeps_big_buffers_in_ordinary_memory(ranks):
    """A default Docker container has 64 MB of /dev/shm: a 64 MiB allreduce there died of SIGBUS in both ranks."""
    results = ranks("mpi", 2, FORCED).run(short_of_shared_memory, 40 << 20)
    for rank, (status, values, summed, ordinary, warned) in enumerate(results):
        assert status.startswith("on: 2 ranks per node share 9.75 MB each, not 32: /dev/shm has 40 MB free"), status
        assert "--shm-size" in status and values == [3.0] and summed == [3.0] and ordinary
        assert len(warned) == (rank == 0) and all("does not fit" in w and "--shm-size" in w for w in warned), warned
    results = ranks("mpi", 2, FORCED).run(short_of_shared_memory, 2 << 20)
    for status, values, summed, ordinary, warned in results:
        assert status.startswith("off: /dev/shm has 2 MB free") and "plain MPI" in status, status
        assert values == [3.0] and summed == [3.0] and ordinary and not warned


SMALL_SHM = """
import torch, hpdl
comm = hpdl.init()
t = torch.full((16 << 20,), float(comm.rank + 1))
comm.allreduce(t)
buffer = comm.shared_buffer(8 << 20)
buffer.fill_(1.0)
comm.allreduce(buffer)
print(f"rank {comm.rank}: {t.unique().tolist()} {buffer.unique().tolist()} {comm.shm_status}", flush=True)
"""


def test_a_real_64_mb_dev_shm_runs_big_collectives(tmp_path):
    """The container's case for real: a private mount of a 64 MB tmpfs on /dev/shm (root and unshare needed)."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64m tmpfs /dev/shm"],
                           capture_output=True, text=True)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm here (unshare -m needs root): {probe.stderr.strip()}")
    script = tmp_path / "small_shm.py"
    script.write_text(SMALL_SHM)
    launch = f"{sys.executable} -m hpdl.cli.main launch -n 2 {script}"
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64m tmpfs /dev/shm && {launch}"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stdout + done.stderr  # before: "signaled with Bus error" on both ranks
    for rank in (0, 1):
        assert f"rank {rank}: [3.0] [2.0] on: 2 ranks per node share" in done.stdout, done.stdout
    assert "not 32: /dev/shm has" in done.stdout, done.stdout


def default_thresholds(comm):
    """Between the two thresholds only all-zero-copy calls take shared memory; mixed calls agree on MPI."""
    from hpdl.comm import shm

    zero_copy_from, ordinary_from = shm.DEFAULT_THRESHOLDS["allreduce"]
    n = (zero_copy_from + ordinary_from) // 2 // 4  # float32: above the zero-copy threshold, below the ordinary one
    window = comm.shared_buffer(n)
    window.fill_(comm.rank + 1)
    before = comm._node._phase
    comm.allreduce(window)
    shared_phases = comm._node._phase - before
    plain = torch.full((n,), float(comm.rank + 1))
    before = comm._node._phase
    comm.allreduce(plain)
    plain_phases = comm._node._phase - before
    mixed = window if comm.rank == 0 else plain
    mixed.fill_(comm.rank + 1)
    comm.allreduce(mixed)
    pieces = -(-n // comm._node._chunk(torch.float32))
    return shared_phases, plain_phases, float(window[0]), float(plain[-1]), float(mixed.sum()) / n, pieces


def test_default_thresholds_agree_on_one_path(ranks):
    total = 3.0
    for shared_phases, plain_phases, shared, plain, mixed, pieces in ranks("mpi", 2).run(default_thresholds):
        # agreement + two meetings a piece: every rank's tensor in a shared buffer, each rank writes its slice's
        # sums into the others' too (three where a rank's results must be copied from a staged rank's segment)
        assert shared_phases == 1 + 2 * pieces
        assert plain_phases == 1  # agreement only: the ordinary tensor went through MPI
        assert shared == total and plain == total and mixed == total


SETTINGS = """
import os, sys
from mpi4py import MPI
if MPI.COMM_WORLD.Get_rank() == 0:  # set on one rank only (any launcher: no per-rank flags of one MPI)
    os.environ.update(HPDL_SHM_MIN_ALLREDUCE="0", HPDL_SHM_PIECE_MB="1")
import hpdl
try:
    hpdl.init(timeout=30)
    said = "started"
except ValueError as error:
    said = f"refused: {error}"
with open(f"{sys.argv[1]}/rank{MPI.COMM_WORLD.Get_rank()}.txt", "w") as out:  # (lines on one stdout interleave)
    out.write(said)
"""


def test_ranks_that_read_different_path_settings_are_refused_at_init(tmp_path):
    """Found in review: a threshold set on one rank only sent one call down two paths (a hang until the timeout).
    The settings that choose a path are compared when the communicator is made."""
    script = tmp_path / "settings.py"
    script.write_text(SETTINGS)
    started = time.monotonic()
    done = subprocess.run(
        [*mpiexec_argv(2), sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    files = [tmp_path / f"rank{rank}.txt" for rank in range(2)]
    said = [file.read_text() if file.exists() else "(nothing)" for file in files]
    assert all(line.startswith("refused:") for line in said), (said, done.stdout, done.stderr)
    for line in said:  # every rank names each setting with every rank's value, and says what to do
        assert re.search(r"HPDL_SHM_MIN_ALLREDUCE \(ordinary tensors\): rank 0 0, rank 1 [1-9]", line), line
        assert "HPDL_SHM_PIECE_MB (bytes): rank 0 1048576, rank 1 4194304" in line, line
        assert "set the same values on every rank" in line
    assert time.monotonic() - started < 60
