"""The "hpdl" torch.distributed backend: the same torch code on hpdl and on gloo gives the same results.

One pool of MPI ranks per size (2 and 3) hosts every body; each rank calls
`dist.init_process_group("hpdl")` itself (see torch_backend_bodies.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import torch_backend_bodies as bodies
from conftest import RankError
from hpdl.runtime.environment import torch_release

POOL_ENV = {"HPDL_TEST_POOL": "torch-backend"}
"""A pool of its own: these ranks hold a torch.distributed default group that other tests must not see."""


@pytest.fixture(params=[2, 3], ids=["2-ranks", "3-ranks"])
def pool(request, ranks):
    return ranks("mpi", request.param, POOL_ENV)


def _same(hpdl_result, gloo_result):
    assert hpdl_result.keys() == gloo_result.keys()
    for key in hpdl_result:
        mine, theirs = hpdl_result[key], gloo_result[key]
        if isinstance(mine, torch.Tensor):
            assert mine.dtype == theirs.dtype and mine.shape == theirs.shape and torch.equal(mine, theirs), key
        else:
            assert mine == theirs, key


def test_every_collective_equals_gloo(pool):
    hpdl_results = pool.run(bodies.collectives, "hpdl", timeout=120)
    gloo_results = pool.run(bodies.collectives, "gloo", timeout=120)
    for mine, theirs in zip(hpdl_results, gloo_results):
        _same(mine, theirs)


def test_avg_and_premul_sum_scale_the_sum(pool):
    for result in pool.run(bodies.hpdl_only_reductions):
        for n, (avg, premul, total, scattered, scattered_sum) in result.items():
            assert avg == pytest.approx([v / pool.nprocs for v in total], rel=1e-12), n
            if isinstance(premul, str):  # torch 2.11/2.12: the factor is not readable, a clear error instead
                assert "does not show the op's factor to Python" in premul and torch_release() < (2, 13), premul
                continue
            assert premul == pytest.approx([v * 0.25 for v in total], rel=1e-12), n
            assert scattered == pytest.approx([v * 0.5 for v in scattered_sum], rel=1e-12), n


def test_the_group_answers_torchs_questions_about_its_backend(pool):
    """torch 2.14's batch_isend_irecv reads `group._get_backend(device).supports_coalescing` (uncaught): on a
    Python group without a C++ backend that raised, and pipelining's sends failed."""
    for answers, refused in pool.run(bodies.backend_capabilities):
        assert answers == [("hpdl", False, True), ("hpdl", False, True), ("hpdl", False, False)]  # (its pool: CPU)
        assert refused == "No backend type associated with device type meta"


def test_async_point_to_point_and_objects_equal_gloo(pool):
    for mine, theirs in zip(pool.run(bodies.async_and_objects, "hpdl"), pool.run(bodies.async_and_objects, "gloo")):
        _same(mine, theirs)


def test_a_blocking_call_runs_to_its_end_before_it_returns(pool):
    """torch >= 2.6 tells the backend when the caller waits at once (asyncOp=False): an operation that finishes
    within the tight loop's bound comes back complete, without a pass through the progress thread."""
    k = pool.nprocs
    total, last = float(k * (k + 1) // 2), float(k)
    for result in pool.run(bodies.blocking_calls_complete_on_return):
        assert result[("blocking", "allreduce")] == (True, total, total)
        assert result[("blocking", "broadcast")] == (True, last, last)
        assert result[("async", "allreduce")] == (None, total, total)
        assert result[("async", "broadcast")] == (None, last, last)


def test_a_blocking_call_leaves_other_threads_free_to_issue_theirs(pool):
    """Found in review: a blocking all_reduce that held the backend's lock for the whole call kept rank 0's other
    thread from sending what rank 1 needed first; both ranks then timed out."""
    results = pool.run(bodies.blocking_call_beside_another_thread, timeout=60)
    for rank, (reduced, received) in enumerate(results):
        assert reduced == [float(pool.nprocs)] * 4
        assert received == ([7.0] * 4 if rank == 1 else None)


def test_collectives_start_at_once_and_callbacks_keep_their_place(pool):
    """Found measuring DDP: the backend made the issuing thread wait for the group's previous collective before
    starting the next, so DDP's next bucket stalled the backward pass. Now only a future with Python callbacks
    holds later collectives back (a callback may issue one); see the body for the cases."""
    k = pool.nprocs
    total = float(k * (k + 1) // 2)
    results = pool.run(bodies.issue_order_with_a_late_rank, timeout=60)
    for rank, out in enumerate(results):
        if rank == 0:
            assert out["issue seconds"] < bodies.LATE_SECONDS / 4, out["issue seconds"]
        assert out["in flight together"] == ([total] * 2, [total] * 3)
        assert out["callback issues one"] == ([total] * 5, [total] * 3, [total] * 7)
        assert out["callback waits for a later one"] == ([total] * 4, [total] * 6)
        assert out["collect_all's callback issues one"] == ([total] * 9, [total] * 5, [total] * 7)
        assert out["receive's callback"] == ([total] * 3, [7.0] * 2 if rank == 1 else [0.0] * 2)
        assert out["blocking, alone, a peer late"] == ([float(k)] * 3, [float(k)] * 2)
        assert out["callback waits for its own"] == ([total] * 5, True)
        for how in ("work", "future"):
            assert out[f"same batch, {how}"] == ([total] * 4, [total] * 6, [total] * 8)
        assert out["destroyed in flight"] == ([total] * 2, [total] * 8)


def test_waiting_for_a_callback_run_by_another_thread_is_bounded(pool):
    """Found in review: `work.wait()` while the progress thread ran the work's future's callback waited without
    a bound (a callback that never returns hung the caller); now it fails after the group's timeout."""
    waited, error = pool.run(bodies.a_callback_that_runs_too_long, timeout=60)[0]
    assert 0.4 < waited < 1.2, waited
    assert error is not None and "callback" in error and "0.5 s" in error, error


def test_functional_collectives_equal_gloo(pool):
    for mine, theirs in zip(pool.run(bodies.functional, "hpdl"), pool.run(bodies.functional, "gloo")):
        _same(mine, theirs)


def test_a_rank_that_destroys_the_group_early_fails_the_others_collective_at_once(ranks):
    """Not the whole timeout: the progress engine looks at the peers while a collective waits."""
    results = ranks("mpi", 3, POOL_ENV).run(bodies.finishes_early, timeout=60)
    assert results[0][0] < 10, results  # its exit barrier saw the others in a collective it never called
    for waited, error in results[1:]:
        assert error.startswith("CollectiveMismatchError") and "rank 0 (after 1 collectives)" in error, error
        assert "finished (hpdl.finalize, the end of its script, or an error) without calling it" in error, error
        assert waited < 10, results


def test_new_group_members_meet_within_the_timeout_and_again_after_it(ranks):
    """The meeting before MPI_Comm_create_group: a missing member is a timeout naming it, and a later meeting
    of the same ranks works (the timed-out receives were cancelled)."""
    first, second, third = ranks("mpi", 3).run(bodies.meeting_with_a_missing_rank, 1.0, timeout=60)
    assert "no word from rank(s) [2] within 1 s" in first[0], first
    assert "no answer from rank(s) [0]" in second[0], second
    assert third[0] == "came" and first[1] == second[1] == third[1] == "met"


def test_subgroups_and_device_mesh(pool):
    results = pool.run(bodies.subgroups)
    for rank, result in enumerate(results):
        if rank < 2:
            assert result["hpdl"] == result["gloo"]
            assert result["opposite orders"] == ([3.0] * 5, [30.0] * 7)
        assert result["mesh"] == ([sum(range(1, pool.nprocs + 1))] * 3, "HpdlProcessGroup")


def test_destroy_and_init_again(pool):
    for before, values, backend in pool.run(bodies.reinit):
        assert not before and values == [pool.nprocs] * 2 and backend == "hpdl"


def test_mismatched_shapes_in_debug_mode(ranks):
    pool = ranks("mpi", 2, POOL_ENV)
    errors = pool.run(bodies.mismatched_shapes, expect_errors=True)
    assert all(isinstance(e, RankError) and e.type_name == "CollectiveMismatchError" for e in errors), errors


def test_torchrun_launch_fails_at_once_with_how_to_launch():
    env = dict(os.environ, TORCHELASTIC_RUN_ID="t", RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    env.update(MASTER_PORT="29533", LOCAL_RANK="0")
    env.pop("HPDL_BACKEND", None)
    code = "import torch.distributed as dist, hpdl; dist.init_process_group('hpdl')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "hpdl launch -n N" in done.stderr and "mpiexec -n N" in done.stderr, done.stderr[-2000:]


TWO_BACKENDS = """
import os, time, torch, torch.distributed as dist, hpdl
from mpi4py import MPI
from hpdl.interop.torch_backend.process_group import python_backends


def say(*words):  # one write per line: the ranks share the pipe
    os.write(1, (" ".join(map(str, words)) + "\\n").encode())


# (torch >= 2.14: gloo stands in for NCCL on CUDA tensors, which needs a GPU to start)
spec = "cpu:hpdl,cuda:gloo" if python_backends() else "cpu:hpdl,cuda:nccl"
time.sleep(MPI.COMM_WORLD.Get_rank())  # a late rank: the first to be refused must not leave it hanging
try:
    dist.init_process_group(spec)
    cpu = dist.group.WORLD._get_backend(torch.device("cpu"))
    say("initialized", dist.get_backend(), type(dist.group.WORLD).__name__, type(cpu).__name__)
    t, before = torch.full((2,), dist.get_rank() + 1.0), cpu.comm._seq
    dist.all_reduce(t)
    say("cpu tensors on hpdl", t.tolist(), cpu.comm._seq - before)
    torch.manual_seed(0)  # DDP on the group: the whole batch's gradient, as one process computes it
    model, x = torch.nn.Linear(3, 2).double(), torch.randn(8, 3, dtype=torch.float64)
    whole = torch.autograd.grad(model(x).square().mean(), model.weight)[0]
    ddp, before = torch.nn.parallel.DistributedDataParallel(model), cpu.comm._seq
    ddp(x.chunk(2)[dist.get_rank()]).square().mean().backward()
    say("ddp equal", torch.allclose(model.weight.grad, whole, rtol=0, atol=1e-12), cpu.comm._seq > before)
    from torch.distributed.fsdp import fully_shard  # FSDP2's buffers from hpdl's pool, through the Backend
    from hpdl.interop.torch_backend.buffer_pool import pool

    sharded = fully_shard(torch.nn.Linear(1024, 512), mesh=dist.device_mesh.init_device_mesh("cpu", (2,)))
    sharded.set_allocate_memory_from_process_group_for_comm(True)
    for _ in range(2):
        sharded(torch.randn(4, 1024)).sum().backward()
    say("fsdp2 buffers from the pool", pool.made > 0 and pool.reused > 0)
    dist.destroy_process_group()
except Exception as exc:
    say(type(exc).__name__, exc)
dist.init_process_group("cpu:hpdl,cuda:hpdl")  # hpdl for both: one group, as asked
t = torch.ones(2)
dist.all_reduce(t)
say("both on hpdl", t.tolist(), type(dist.group.WORLD).__name__)
try:  # a sub-group: torch asks only its members (here rank 0)
    group = dist.new_group([0], backend=spec)
    if dist.get_rank() == 0:
        say("sub-group", type(group._get_backend(torch.device("cpu"))).__name__)
except Exception as exc:
    say(type(exc).__name__, str(exc)[:40])
dist.barrier()
say("after the sub-group")
"""


def test_hpdl_beside_another_backend_serves_its_devices_or_is_refused_not_dropped_in_silence():
    """torch < 2.14 lets a Python process group replace the whole group: "cpu:hpdl,cuda:nccl" gave hpdl every
    tensor, CUDA ones included, while dist.get_backend() still said "cpu:hpdl,cuda:nccl": refused, saying what to
    do, and the program may then try again with "hpdl" (every rank refuses only after every rank has left the
    rendezvous, else a late rank kept connecting to the store of the failed attempt: both ranks hung). torch >=
    2.14 reaches a Python `Backend` (its PyBackend trampoline): hpdl then serves CPU tensors in torch's own
    group beside the other backend (run on 2.14.1: the suite pins 2.13)."""
    from hpdl.interop.torch_backend.process_group import python_backends
    from hpdl.runtime.spawn import mpiexec_argv

    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [*mpiexec_argv(2), sys.executable, "-c", TWO_BACKENDS], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    said = done.stdout
    if python_backends():
        assert said.count("initialized cpu:hpdl,cuda:gloo ProcessGroup HpdlBackend") == 2, said
        assert said.count("cpu tensors on hpdl [3.0, 3.0] 1") == 2, said  # one hpdl call per rank, summed
        assert said.count("ddp equal True True") == 2, said
        assert said.count("fsdp2 buffers from the pool True") == 2, said
        assert said.count("sub-group HpdlBackend") == 1, said
    else:
        assert said.count("LaunchError init_process_group('cpu:hpdl,cuda:nccl')") == 2, said  # every rank refused
        assert "cuda:nccl would be ignored" in said and "dist.new_group(backend='hpdl')" in said, said
        assert "torch >= 2.14" in said and "initialized" not in said, said
        assert said.count("LaunchError new_group('cpu:hpdl,cuda:nccl')") == 1, said  # rank 0's, rank 1 not asked
    assert said.count("both on hpdl [2.0, 2.0] HpdlProcessGroup") == 2, said
    assert said.count("after the sub-group") == 2, said


def test_a_torch_older_than_the_backend_is_named_not_failed(monkeypatch):
    """`unavailable()` says why an older torch cannot run the backend: create_process_group raises it, and
    `hpdl bench gpu` reports its rows n/a instead of failing the check (seen on torch 2.4.1)."""
    from hpdl.interop.torch_backend.factory import unavailable

    assert unavailable() == ""  # the pinned torch
    for old in ("2.4.1+cu121", "2.10.0"):
        monkeypatch.setattr(torch, "__version__", old)
        assert unavailable() == f"the hpdl torch.distributed backend needs torch >= 2.11 (this is {old})"
    monkeypatch.setattr(torch, "__version__", "2.14.0a0+git1234")
    assert unavailable() == ""


STORE_REFUSED = """
import datetime, sys, time
import torch.distributed as dist
from mpi4py import MPI
import hpdl
import hpdl.runtime.store
rank = MPI.COMM_WORLD.Get_rank()
if rank == 0:
    def refuse(*args, **kwargs):
        raise RuntimeError("no store on purpose")
    hpdl.runtime.store._server = refuse
started = time.monotonic()
try:
    if sys.argv[2] == "init_process_group":
        dist.init_process_group("hpdl", timeout=datetime.timedelta(seconds=60))
    else:
        hpdl.init("torch", timeout=60)
    said = "initialized"
except Exception as exc:
    said = f"{type(exc).__name__}: {exc}"
with open(f"{sys.argv[1]}/{rank}.txt", "w") as out:
    out.write(f"{time.monotonic() - started:.1f} {said}")
"""


@pytest.mark.parametrize("caller", ["init_process_group", "hpdl.init"])
def test_a_store_that_rank_0_cannot_open_fails_every_rank_at_once(tmp_path, caller):
    """Under plain mpiexec, rank 0 opens the rendezvous store before it tells the others its port: when it cannot,
    they hear why at once, instead of trying to connect for the whole timeout (60 s here, 30 minutes by default).
    The same for the backend's `init_process_group("hpdl")` and for `hpdl.init("torch")`."""
    from hpdl.runtime.spawn import mpiexec_argv

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPDL_", "MASTER_", "RANK", "WORLD_SIZE"))}
    command = [*mpiexec_argv(2), sys.executable, "-c", STORE_REFUSED, str(tmp_path), caller]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (took_0, said_0), (took_1, said_1) = ((tmp_path / f"{r}.txt").read_text().split(" ", 1) for r in (0, 1))
    assert said_0 == "RuntimeError: no store on purpose"
    assert said_1 == (
        f"BackendUnavailableError: {caller}: rank 0 could not open the rendezvous store "
        "(RuntimeError: no store on purpose)"
    )
    assert float(took_1) < 30, took_1


def test_import_torch_registers_the_backend_unless_autoload_is_off():
    """The package's "torch.backends" entry point: before torch 2.14 `import torch` alone makes "hpdl" a backend
    (by name: hpdl itself is imported when a group asks for it); with torch's autoload off
    (TORCH_DEVICE_BACKEND_AUTOLOAD=0) only `import hpdl` does. torch >= 2.14 finds it when asked for
    ("torch.distributed.backends"), so the autoload registers nothing there."""
    probe = (
        "import sys, torch.distributed as dist; before = 'hpdl' in dist.Backend.backend_list; "
        "import hpdl; print(before, 'hpdl' in dist.Backend.backend_list)"
    )
    eager = str(torch_release() < (2, 14))
    for autoload, expected in (("1", f"{eager} True"), ("0", "False True")):
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD=autoload)
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == expected.split(), (autoload, done.stdout, done.stderr[-2000:])


def test_a_failing_registration_never_breaks_import_torch():
    """Whatever goes wrong in hpdl's registration, `import torch` succeeds (its entry point imports nothing of
    hpdl), and the program that asks for "hpdl" is told why it cannot have it. The probe breaks `register` as its
    module finishes loading, so the failure happens on that path."""
    probe = """
import importlib.abc, importlib.machinery, sys, warnings
warnings.simplefilter("always")

class Break(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "hpdl.interop.registration":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            def broken():
                raise OSError("no store today")
            module.register = broken

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Break())
import torch.distributed as dist
print("imported", "hpdl" in sys.modules, flush=True)
try:  # what a group of the "hpdl" backend does first (torch 2.14: its entry point, when the group is made)
    getattr(dist.Backend, "_ensure_backend_registered", dist.Backend)("hpdl")
except RuntimeError as error:
    print(error)
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "imported False",
        'the "hpdl" torch.distributed backend was asked for, but hpdl could not register it (OSError: no store today)',
    ], done.stdout + done.stderr[-2000:]
