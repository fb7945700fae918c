"""hpdl's compiled modules give what their Python equivalents give.

The MPI calls under the fast paths (hpdl.comm.mpi_calls), compiled and through mpi4py; the copies of tensor
fusion (hpdl.comm._copies), compiled and through torch.cat / torch._foreach_copy_.

`make install` compiles `_mpi_fast.c` with the `mpicc` that pip's mpich puts
beside the venv's Python; the communicator uses it when its handles match
the running MPI. Each body runs every call through both implementations on
the same inputs (several dtypes and sizes, 0 elements, a wait that hands back
a `Request`) and compares them with each other and with the answer computed
by hand; the whole suite's collectives run on the compiled calls, and here a
pool with HPDL_COMPILED=0 runs the communicator on mpi4py's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DTYPES = (torch.float32, torch.float64, torch.int64)
SIZES = (0, 1, 7, 1000)


def which_calls(comm):
    from hpdl.comm import fusion, shm

    paths = [getattr(comm, name).__qualname__ for name in ("allreduce", "allgather", "reduce_scatter", "broadcast")]
    return comm.calls, paths, [module and module.__name__ for module in (fusion._copies, shm._flags)]


def _implementations():
    from hpdl.comm import mpi_calls

    compiled, why = mpi_calls.compiled_calls()
    assert compiled is not None, why
    return {"compiled": compiled, "mpi4py": mpi_calls.Calls()}


def _types(calls, dtype):
    from mpi4py import MPI

    mpi_type = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE, torch.int64: MPI.INT64_T}[dtype]
    return calls.handle(mpi_type), calls.handle(MPI.SUM), calls.handle(MPI.MAX)


def _done(request):
    """Complete what a call handed back: None (already complete) or a Request."""
    if request is not None and not isinstance(request, int):
        request.Wait()


def every_call(comm, wait):
    """Each call through each implementation; returns {(name, call, dtype, n): values} for the test to compare."""
    mpi_comm, rank, size = comm.mpi_comm, comm.rank, comm.size
    out = {}
    for name, calls in _implementations().items():
        handle = calls.handle(mpi_comm)
        for dtype in DTYPES:
            mpi_type, total, largest = _types(calls, dtype)
            item = torch.empty(0, dtype=dtype).element_size()
            for n in SIZES:
                key = (name, dtype, n)
                mine = (torch.arange(n, dtype=torch.float64) * (rank + 1) + rank).to(dtype)

                t = mine.clone()
                _done(calls.allreduce(handle, t.data_ptr(), n * item, mpi_type, total, wait))
                out[(*key, "allreduce sum")] = t
                t = mine.clone()
                _done(calls.allreduce(handle, t.data_ptr(), n * item, mpi_type, largest, wait))
                out[(*key, "allreduce max")] = t

                gathered = torch.zeros(n * size, dtype=dtype)
                _done(calls.allgather(handle, mine.data_ptr(), gathered.data_ptr(), n * item, mpi_type, wait))
                out[(*key, "allgather")] = gathered
                gathered = torch.zeros(n * size, dtype=dtype)
                gathered[rank * n : (rank + 1) * n] = mine  # in place: this rank's block already there
                _done(calls.allgather(handle, 0, gathered.data_ptr(), n * item, mpi_type, wait))
                out[(*key, "allgather in place")] = gathered

                whole = torch.cat([mine + j for j in range(size)])
                block = torch.zeros(n, dtype=dtype)
                _done(calls.reduce_scatter(handle, whole.data_ptr(), block.data_ptr(), n * item, mpi_type, total, wait))
                out[(*key, "reduce_scatter")] = block

                t = mine.clone()
                _done(calls.broadcast(handle, t.data_ptr(), n * item, mpi_type, size - 1, wait))
                out[(*key, "broadcast")] = t

                if rank < 2:  # a ring between ranks 0 and 1
                    peer = 1 - rank
                    got = torch.full((n,), -1, dtype=dtype)
                    if rank == 0:
                        _done(calls.send(handle, mine.data_ptr(), n * item, mpi_type, peer, 5, wait))
                        received = calls.recv(handle, got.data_ptr(), n * item, mpi_type, peer, 6, wait)
                    else:
                        received = calls.recv(handle, got.data_ptr(), n * item, mpi_type, peer, 5, wait)
                        _done(calls.send(handle, mine.data_ptr(), n * item, mpi_type, peer, 6, wait))
                    if not isinstance(received, int):  # not complete within `wait`: a Request to finish
                        from mpi4py import MPI

                        status = MPI.Status()
                        received.Wait(status)
                        received = status.Get_count(MPI.BYTE)
                    out[(*key, "sendrecv")] = (got, received)
    return out


def _expected(call, dtype, n, rank, size):
    def contribution(r):
        return (torch.arange(n, dtype=torch.float64) * (r + 1) + r).to(dtype)

    everyone = [contribution(r) for r in range(size)]
    if call == "allreduce sum":
        return sum(everyone, torch.zeros(n, dtype=dtype))
    if call == "allreduce max":
        return torch.stack(everyone).amax(0) if n else torch.zeros(0, dtype=dtype)
    if call.startswith("allgather"):
        return torch.cat(everyone)
    if call == "reduce_scatter":
        return sum((c + rank for c in everyone), torch.zeros(n, dtype=dtype))
    if call == "broadcast":
        return everyone[size - 1]
    assert call == "sendrecv"
    return everyone[1 - rank], n * torch.empty(0, dtype=dtype).element_size()


@pytest.mark.parametrize(
    ("nprocs", "wait"),
    [(2, 2e-3), (3, 2e-3), (2, 0.0), (2, -1.0)],  # the ways back (3 ranks: once; ranks past a send/recv pair)
    ids=["2-wait", "3-wait", "2-test-once", "2-request"],
)
def test_compiled_and_mpi4py_calls_give_the_same_results(ranks, nprocs, wait):
    results = ranks("mpi", nprocs).run(every_call, wait)
    for rank, got in enumerate(results):
        calls = {key[1:] for key in got}
        assert len(calls) == len(DTYPES) * len(SIZES) * (7 if rank < 2 else 6)
        for dtype, n, call in calls:
            expected = _expected(call, dtype, n, rank, nprocs)
            for name in ("compiled", "mpi4py"):
                value = got[(name, dtype, n, call)]
                if call == "sendrecv":
                    assert value[1] == expected[1], (name, dtype, n)
                    value, expected_values = value[0], expected[0]
                else:
                    expected_values = expected
                assert torch.equal(value, expected_values), (name, call, dtype, n, rank)


def test_the_install_built_the_compiled_calls(ranks):
    """`make install` has mpich's mpicc beside the venv's Python: a build that silently fell back would pass every
    other test, slower."""
    assert (Path(sys.executable).parent / "mpicc").exists(), "the dev environment installs mpich (requirements-dev)"
    for calls, paths, modules in ranks("mpi", 2).run(which_calls):
        assert calls == "compiled (hpdl.comm._mpi_fast)"
        assert paths == ["Fast.allreduce", "Fast.allgather", "Fast.reduce_scatter", "Fast.broadcast"]
        assert modules == ["hpdl.comm._copies", "hpdl.comm._flags"]  # fusion's copies, shared memory's flags


def bookkeeping(comm):
    """Blocking calls of every kind the compiled paths take (and some they pass to Python): what each rank records."""
    comm.check_every = 64  # a fresh ring
    while comm._seq % 64 >= 64 - 13:  # and no check among the 13 calls below (a check starts the ring again;
        comm.barrier()  # a pooled rank's sequence number is wherever earlier tests left it)
    size, start = comm.size, comm._seq
    x = torch.arange(5.0)
    results = [
        comm.allreduce(x.clone()),
        comm.allreduce(x.clone(), "max"),
        comm.allreduce(torch.arange(3) * (comm.rank + 1), op="min"),
        comm.allreduce(x.clone(), op="avg"),  # Python: it divides afterwards
        comm.broadcast(x + comm.rank, root=size - 1),
        comm.broadcast(torch.ones(2, dtype=torch.float16) * comm.rank, 0),
        comm.allgather(x + comm.rank, sizes=[5] * size, out=torch.zeros(5 * size)),
        comm.allgather(x + comm.rank, out=torch.zeros(5 * size)),  # no sizes: every rank's taken to be this one's
        comm.allgather(torch.ones(0, 3), sizes=[0] * size, out=torch.zeros(0, 3)),
        comm.reduce_scatter(torch.ones(2 * size, 3) * comm.rank, "sum", out=torch.zeros(2, 3)),
        comm.reduce_scatter(torch.ones(2 * size), "prod"),  # Python: no `out`
    ]
    block = torch.arange(4.0) + comm.rank
    whole = torch.zeros(4 * size)
    whole[4 * comm.rank : 4 * comm.rank + 4] = block
    results.append(comm.allgather(whole[4 * comm.rank : 4 * comm.rank + 4], sizes=[4] * size, out=whole))  # in place
    again = torch.zeros(4 * size)
    again[4 * comm.rank : 4 * comm.rank + 4] = block
    results.append(comm.allgather(again[4 * comm.rank : 4 * comm.rank + 4], out=again))  # in place, no sizes
    entries = [comm._ring[(start + n) % 64] for n in range(1, 14)]  # slot: sequence number modulo 64
    recorded = (comm._seq - start, entries, int(comm._progress._mine[0]) - start, comm.calls)
    comm.check_every = 16
    return results, recorded


@pytest.mark.parametrize("nprocs", [2, 3])
def test_compiled_paths_record_and_return_what_python_does(ranks, nprocs):
    compiled = ranks("mpi", nprocs).run(bookkeeping)
    python = ranks("mpi", nprocs, env={"HPDL_COMPILED": "0"}).run(bookkeeping)
    for (values, recorded), (expected_values, expected) in zip(compiled, python):
        assert recorded[3].startswith("compiled") and expected[3].startswith("mpi4py")
        assert recorded[:3] == expected[:3]
        assert recorded[0] == 13 and recorded[2] == 13 and all(recorded[1])
        for value, expected_value in zip(values, expected_values):
            assert value.dtype == expected_value.dtype and torch.equal(value, expected_value)


def brief_starts(comm):
    """`start_briefly`: a call both ranks make together completes in it; one whose peer comes 0.2 s late comes
    back running after the short wait, and its wait gives the answer; what the fast path does not take starts
    nothing."""
    import time

    from hpdl.comm.base import DECLINED

    rank, size = comm.rank, comm.size
    out = {}
    comm.barrier()
    x = torch.arange(5.0) + rank
    work = comm.start_briefly("allreduce", x, "sum")  # None, unless a rank was descheduled after the barrier
    if work is not None:
        work.wait()
    out["together"] = x
    for op, arg in (("allreduce", "max"), ("broadcast", size - 1)):
        y = torch.arange(3, dtype=torch.int64) * (rank + 1)
        comm.barrier()
        if rank == 1:
            time.sleep(0.2)
        started = time.perf_counter()
        work = comm.start_briefly(op, y, arg)
        returned_after = time.perf_counter() - started
        running = work is not None
        if running:
            work.wait()
        out[op] = (rank == 0 and running and returned_after < 0.1) or rank == 1, y
    seq = comm._seq
    declined = [
        comm.start_briefly("allreduce", torch.ones(4), "avg"),
        comm.start_briefly("allreduce", torch.ones(4, 2).t(), "sum"),  # not contiguous
        comm.start_briefly("allreduce", torch.ones(1 << 24), "sum"),  # the shared-memory route's size
        comm.start_briefly("broadcast", torch.ones(4), size),  # no such root
        comm.start_briefly("allreduce", torch.ones(4, dtype=torch.float16), "sum"),  # widened on the general path
        comm.start_briefly("allreduce", torch.ones(4, dtype=torch.complex64), "max"),  # the general path's error
    ]
    out["declined"] = all(d is DECLINED for d in declined) and comm._seq == seq
    out["general path after"] = comm.allreduce(torch.ones(4, dtype=torch.float16))  # not stopped at the door
    return out


@pytest.mark.parametrize("env", [None, {"HPDL_COMPILED": "0"}], ids=["compiled", "mpi4py"])
def test_a_brief_start_completes_or_hands_back_the_running_call(ranks, env):
    results = ranks("mpi", 2, env=env).run(brief_starts)
    for out in results:
        assert torch.equal(out["together"], torch.arange(5.0) * 2 + 1)
        assert out["allreduce"][0] and torch.equal(out["allreduce"][1], torch.arange(3) * 2)
        assert out["broadcast"][0] and torch.equal(out["broadcast"][1], torch.arange(3) * 2)
        assert out["declined"]
        assert torch.equal(out["general path after"], torch.full((4,), 2.0, dtype=torch.float16))


def collectives_on_the_communicator(comm):
    rank, size = comm.rank, comm.size
    x = torch.arange(6, dtype=torch.float64) + rank
    summed = comm.allreduce(x.clone())
    gathered = comm.allgather(x, sizes=[6] * size, out=torch.empty(6 * size, dtype=torch.float64))
    block = comm.reduce_scatter(torch.arange(2.0 * size) + rank)
    root = comm.broadcast(x.clone(), root=size - 1)
    if rank == 0:
        comm.send(x, 1)
        got = None
    else:
        got = comm.recv(torch.empty(6, dtype=torch.float64), 0) if rank == 1 else None
    return comm.calls, summed, gathered, block, root, got


def test_the_communicator_runs_on_mpi4py_calls_when_told(ranks):
    results = ranks("mpi", 2, env={"HPDL_COMPILED": "0"}).run(collectives_on_the_communicator)
    x = [torch.arange(6, dtype=torch.float64) + r for r in range(2)]
    for rank, (calls, summed, gathered, block, root, got) in enumerate(results):
        assert calls == "mpi4py (HPDL_COMPILED=0)"
        assert torch.equal(summed, x[0] + x[1])
        assert torch.equal(gathered, torch.cat(x))
        assert torch.equal(block, (torch.arange(4.0) * 2 + 1)[2 * rank : 2 * rank + 2])
        assert torch.equal(root, x[1])
        assert got is None if rank == 0 else torch.equal(got, x[0])
    for _, _, modules in ranks("mpi", 2, env={"HPDL_COMPILED": "0"}).run(which_calls):
        assert modules == [None, None]  # fusion copies through torch, shared-memory flags through MPI_Win_sync


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
def test_fusion_packs_and_unpacks_like_torch_cat(monkeypatch, compiled):
    from hpdl.comm import fusion

    assert fusion._copies is not None, "make install compiles hpdl/comm/_copies.c"
    if not compiled:
        monkeypatch.setattr(fusion, "_copies", None)
    generator = torch.Generator().manual_seed(0)
    sizes = [1, 3, 1024, 0, 7, 4096, 5] * 6
    tensors = [torch.randn(n, generator=generator, dtype=torch.float64) for n in sizes]
    tensors += [torch.randint(-9, 9, (n,), generator=generator) for n in sizes]  # a second bucket: int64
    tensors.append(torch.randn(3, 5, generator=generator))  # 2-D, float32: a third
    packer = fusion.Packer()
    for step in range(3):  # the plan is made once, then found again by the tensors' addresses
        before = [t.clone() for t in tensors]
        versions = [t._version for t in tensors]
        plan = packer.acquire(tensors, 1 << 20)
        for bucket in plan.buckets:
            bucket.fill()
        assert all((bucket.table is not None) == (compiled and len(bucket.targets) > 1) for bucket in plan.buckets)
        assert len(plan.buckets) == 3
        for bucket in plan.buckets:
            assert torch.equal(bucket.flat, torch.cat([t.reshape(-1) for t in bucket.targets]))
            bucket.flat.mul_(2).add_(step)  # a bucket of one tensor is that tensor: changed here already
        for bucket in plan.buckets:
            bucket.unpack()
        plan.busy = False
        for old, new, version in zip(before, tensors, versions):
            assert torch.equal(new, old * 2 + step)
            assert new._version > version  # autograd sees the tensors changed, as after torch's own copies


def test_fusion_copies_a_byte_range_of_the_tensors():
    """What the shared-memory route stages per piece: any byte range of the tensors' concatenation, out and in."""
    from hpdl.comm import fusion

    generator = torch.Generator().manual_seed(1)
    tensors = [torch.randn(n, generator=generator, dtype=torch.float64) for n in (5, 0, 17, 1, 40)]
    (bucket,) = fusion.pack(tensors, 1 << 20)
    whole = torch.cat(tensors).view(torch.uint8)
    out = torch.zeros(whole.numel(), dtype=torch.uint8)
    for start, length in ((0, whole.numel()), (3, 50), (40, 8), (47, 137), (whole.numel(), 0), (100, 400)):
        out.zero_()
        bucket.pack_range(out.data_ptr(), start, length)
        assert torch.equal(out[:length], whole[start : start + length]) and not out[length:].any()
    versions = [t._version for t in tensors]
    incoming = torch.arange(whole.numel(), dtype=torch.int64).remainder(251).to(torch.uint8)
    expected = whole.clone()
    expected[45:301] = incoming[:256]
    bucket.unpack_range(incoming.data_ptr(), 45, 256)
    bucket.modified()
    assert torch.equal(torch.cat(tensors).view(torch.uint8), expected)
    assert all(t._version > v for t, v in zip(tensors, versions))
    with pytest.raises(ValueError, match="runs past"):
        bucket.pack_range(out.data_ptr(), whole.numel() - 4, 8)


def test_fusion_leaves_tensors_autograd_tracks_to_torch():
    from hpdl.comm import fusion

    leaves = [torch.ones(3, requires_grad=True), torch.ones(4, requires_grad=True)]
    (bucket,) = fusion.pack(leaves, 1 << 20)
    assert bucket.table is None
    with pytest.raises(RuntimeError, match="automatic differentiation"):
        bucket.fill()  # what torch.cat says; the memcpy loop would have copied silently


def counted_window(comm):
    import os

    from hpdl.comm import mpi_calls
    from hpdl.comm.mpi_backend import library_version

    windows = {"library": comm._counted_reduce_scatter, "gate": comm._fast_reduce_scatter_below}
    windows["this library"] = mpi_calls.counted_reduce_scatter(library_version())
    windows["default"] = mpi_calls.MPICH_COUNTED_REDUCE_SCATTER
    windows["mpich"] = mpi_calls.counted_reduce_scatter("MPICH 5.0.2")
    windows["open mpi"] = mpi_calls.counted_reduce_scatter("Open MPI v5.0.5")
    for text in ("0", "1000:2000", "2000:1000", "big"):
        os.environ["HPDL_COUNTED_REDUCE_SCATTER"] = text
        try:
            windows[text] = mpi_calls.counted_reduce_scatter("MPICH 5.0.2")
        except ValueError as exc:
            windows[text] = str(exc)
    del os.environ["HPDL_COUNTED_REDUCE_SCATTER"]
    return windows


def test_mid_size_reduce_scatter_window_leaves_the_fast_path_and_reads_its_setting(ranks):
    """The window is the general path's where the call would reach MPI (3 ranks); on 2 ranks messages carry every
    size below the shared-memory gate, and the fast path keeps them (the general path's Python wait cost 1 MiB
    of input 1.3x)."""
    windows, paired = ranks("mpi", 3).run(counted_window)[0], ranks("mpi", 2).run(counted_window)[0]
    mpich = windows["default"]
    assert windows["mpich"] == mpich and windows["open mpi"] == (0, 0)
    this = windows["this library"]  # MPICH's window (the pinned environment), none on Open MPI
    assert windows["library"] == this == paired["library"]
    if this[0] < this[1]:
        assert windows["gate"] == this[0]
        assert paired["gate"] > this[1]
    assert windows["0"] == (0, 0) and windows["1000:2000"] == (1000, 2000)
    assert "FROM <= TO" in windows["2000:1000"] and "must be FROM:TO" in windows["big"]


def test_the_mpi_module_links_the_wrappers_libmpi_where_another_libmpi_is_found_first(tmp_path):
    """A machine with a system MPI's development files (Open MPI's libmpi.so in Python's own library folder) and
    pip's mpich: `-lmpi` found the system's library first and the module ran on another MPI instance than mpi4py's
    (seen on a GPU machine, where the fast path then fell back to mpi4py). A decoy libmpi.so on the linker's path
    ahead of the wrapper's own must not be the one linked."""
    root = Path(__file__).resolve().parents[1]
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    (tmp_path / "empty.c").write_text("int hpdl_decoy;\n")
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler (the install builds hpdl's modules with it)"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-o", decoy / "libmpi.so", "-Wl,-soname,libdecoy_mpi.so", tmp_path / "empty.c"],
        check=True,
    )
    built = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "-b", tmp_path / "lib", "-t", tmp_path / "obj"],
        cwd=root,
        env={**os.environ, "LDFLAGS": f"-L{decoy}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    module = next((tmp_path / "lib" / "hpdl" / "comm").glob("_mpi_fast*.so"))
    needed = subprocess.run(["readelf", "-d", module], capture_output=True, text=True, check=True).stdout
    assert "libdecoy_mpi.so" not in needed
    assert "[libmpi.so" in needed, needed


def compiled_counts(comm):
    """One small blocking call of each kind the compiled `Fast` takes (send and recv between ranks 0 and 1), and one
    it leaves to Python (async_op): how many calls it counted for each; the state's type; and the agreement entry
    as C and Python encode it."""
    from hpdl.comm import _mpi_fast, agreement, fast_state  # type: ignore[attr-defined]

    size = comm.size
    before = comm._compiled.taken()
    comm.allreduce(torch.ones(1))
    comm.broadcast(torch.ones(1), root=size - 1)
    comm.allgather(torch.ones(1), out=torch.empty(size))
    comm.reduce_scatter(torch.ones(size), out=torch.empty(1))
    comm.allreduce(torch.ones(1), async_op=True).wait()  # the Python fast path's
    if comm.rank < 2:  # ranks 0 and 1: one send and one receive each
        got = torch.zeros(2)
        for sends in (comm.rank == 0, comm.rank == 1):
            comm.send(torch.ones(2), 1 - comm.rank, tag=3) if sends else comm.recv(got, 1 - comm.rank, tag=3)
        assert got.tolist() == [1.0, 1.0]
    after = comm._compiled.taken()
    fields = sorted(name for name, kind in vars(_mpi_fast.State).items() if type(kind).__name__ == "member_descriptor")
    code = agreement.code("allgather", "float32", "")
    cases = [(0, 0, 0), (0xFFFFFFFF, 0, 0), (code, 4096, 0), (code, 12, -1), (code, (1 << 48) - 1, 10**6)]
    entries = [(_mpi_fast.agreement_entry(*case), agreement.entry(*case)) for case in cases]
    shared = type(comm._state) is _mpi_fast.State and comm._state is not None
    taken = {k: after[k] - before[k] for k in after}
    return taken, fields, sorted(fast_state.FIELDS), entries, shared, comm._probe_first


@pytest.mark.parametrize("nprocs", [2, 3])
def test_the_compiled_path_takes_the_calls_and_shares_state_by_contract(ranks, nprocs):
    """The compiled `Fast` must keep taking the small blocking calls: with its state out of step with Python's (a
    field renamed on one side, a flag Python no longer sets), every call would pass to the Python path, still
    correct, and slower (2 ranks: through the pair's messages; 3: MPI's collectives; send and recv: messages)."""
    for rank, (taken, fields, python_fields, entries, shared, probe_first) in enumerate(
        ranks("mpi", nprocs).run(compiled_counts)
    ):
        peer = int(rank < 2)
        assert taken == {
            "allreduce": 1,
            "allgather": 1,
            "reduce_scatter": 1,
            "broadcast": 1,
            "send": peer,
            "recv": 0 if probe_first else peer,  # (probing first, the Python path receives: pairs.probe_first)
        }
        assert fields == python_fields and shared  # one contract: fast_state.FIELDS, the C struct's members
        assert all(c == p for c, p in entries), entries  # the agreement entry: _mpi_fast.entry_of == agreement.entry


MATRIX_ON_MPI4PY = (
    "test_allreduce_every_dtype_op_size",
    "test_allgather_uneven_sizes",
    "test_allgather_of_rows_that_differ_raises_on_every_rank",
    "test_reduce_scatter",
    "test_broadcast",
    "test_send_recv_ring",
    "test_async_forms",
    "test_allreduce_coalesced",
    "test_results_into_caller_buffers",
    "test_split",
)
"""test_collectives' matrix where the Python fast paths differ from the compiled ones (every dtype, op and size
of each fast path, the agreement entries they record, send/recv, async, fusion's flat buffers, `out`, a split's new
communicator); not its large buffers and alltoall, which take the general path either way, nor the shared-memory
engine's flags without the compiled module (test_shared_memory runs those)."""


@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.parametrize("test", MATRIX_ON_MPI4PY)
def test_the_collective_matrix_on_mpi4py_calls(ranks, nprocs, test):
    """The same tests as test_collectives, on this file's HPDL_COMPILED=0 pools (already started here: no pool
    starts for it), where the Python fast paths take every call: on 2 ranks through the Python pair (pairs.py),
    on 3 through mpi4py's calls (mpi_calls.Calls)."""
    import test_collectives

    getattr(test_collectives, test)(ranks("mpi", nprocs, env={"HPDL_COMPILED": "0"}))
