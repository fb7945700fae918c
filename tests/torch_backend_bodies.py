"""Rank bodies for test_torch_backend.py: the same torch.distributed code on the "hpdl" and the "gloo" group.

The pool's ranks are MPI ranks; each initialises torch.distributed with the
"hpdl" backend once (no MASTER_ADDR: the store's address comes over MPI) and
makes a gloo group of every rank beside it, so that one body runs its torch
code on both and the test compares the results.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.futures import collect_all  # (before any hpdl group exists, as a user's module may import it)

import hpdl  # noqa: F401  (registers the backend)
from hpdl.runtime.environment import torch_release

_GROUPS: dict[str, Any] = {}


def groups() -> dict[str, Any]:
    """{"hpdl": the default group, "gloo": a gloo group of every rank}, made once per process."""
    if not dist.is_initialized():
        dist.init_process_group("hpdl")
        _GROUPS.clear()
    if not _GROUPS:
        _GROUPS["hpdl"] = dist.group.WORLD
        _GROUPS["gloo"] = dist.new_group(backend="gloo")
    return _GROUPS


def _data(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Small integers (exact in every dtype, so sums agree to the last bit on every library)."""
    base = (torch.arange(n, dtype=torch.int64) * 7 + rank * 3 + salt) % 11 - 3
    return base.to(dtype)


SIZES = (0, 7, 4099)
LARGE = 300001
"""One large message (odd size) per collective family, float32 only."""
DTYPES = (torch.float32, torch.int64)  # float64 runs through every training test


def collectives(comm: Any, name: str) -> dict:
    """Every collective of torch.distributed on group `name`; results by key."""
    g = groups()[name]
    rank, size = dist.get_rank(g), dist.get_world_size(g)
    out: dict = {}
    cases = [(dtype, n) for dtype in DTYPES for n in SIZES] + [(torch.float32, LARGE)]
    for dtype, n in cases:
        if True:
            key = (str(dtype), n)
            ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN]
            if dtype == torch.int64:
                ops += [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR]
            for op in ops:
                t = _data(rank, n, dtype)
                dist.all_reduce(t, op=op, group=g)
                out[("all_reduce", str(op), *key)] = t
            t = (_data(rank, n, dtype) % 3 + 1).to(dtype)
            dist.all_reduce(t, op=dist.ReduceOp.PRODUCT, group=g)
            out[("all_reduce", "prod", *key)] = t
            # a non-contiguous tensor
            t = _data(rank, 2 * n, dtype).view(2, n).t()
            dist.all_reduce(t, group=g)
            out[("all_reduce", "strided", *key)] = t.contiguous()
            x = _data(rank, n, dtype)
            gathered = [torch.empty(n, dtype=dtype) for _ in range(size)]
            dist.all_gather(gathered, x, group=g)
            out[("all_gather", *key)] = torch.stack(gathered)
            whole = torch.empty(n * size, dtype=dtype)
            dist.all_gather_into_tensor(whole, x, group=g)
            out[("all_gather_into_tensor", *key)] = whole
            inplace = torch.zeros(n * size, dtype=dtype)
            mine = inplace[rank * n : (rank + 1) * n]
            mine.copy_(x)
            dist.all_gather_into_tensor(inplace, mine, group=g)  # the input is a view of the output (FSDP)
            out[("all_gather_into_tensor", "in-place", *key)] = inplace
            chunks = [_data(rank, n, dtype, salt=j) for j in range(size)]
            result = torch.empty(n, dtype=dtype)
            dist.reduce_scatter(result, chunks, group=g)
            out[("reduce_scatter", *key)] = result
            result = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(result, torch.cat(chunks), group=g)
            out[("reduce_scatter_tensor", *key)] = result
            t = _data(rank, n, dtype)
            dist.broadcast(t, src=size - 1, group=g)
            out[("broadcast", *key)] = t
            t = _data(rank, n, dtype)
            dist.reduce(t, dst=0, group=g)
            if rank == 0:
                out[("reduce", *key)] = t
            gather_list = [torch.empty(n, dtype=dtype) for _ in range(size)] if rank == size - 1 else None
            dist.gather(_data(rank, n, dtype), gather_list, dst=size - 1, group=g)
            if gather_list is not None:
                out[("gather", *key)] = torch.stack(gather_list)
            result = torch.empty(n, dtype=dtype)
            dist.scatter(result, chunks if rank == 0 else None, src=0, group=g)
            out[("scatter", *key)] = result
            even = _data(rank, n * size, dtype)
            result = torch.empty(n * size, dtype=dtype)
            dist.all_to_all_single(result, even, group=g)
            out[("all_to_all_single", *key)] = result
            # uneven: rank r sends (j + r) % 3 + n rows to rank j
            send_rows = [(j + rank) % 3 + (n % 5) for j in range(size)]
            recv_rows = [(rank + j) % 3 + (n % 5) for j in range(size)]
            source = _data(rank, sum(send_rows) * 2, dtype).view(-1, 2)
            result = torch.empty(sum(recv_rows), 2, dtype=dtype)
            dist.all_to_all_single(result, source, recv_rows, send_rows, group=g)
            out[("all_to_all_single", "uneven", *key)] = result
            outs = [torch.empty(n, dtype=dtype) for _ in range(size)]
            if name == "gloo" and torch_release() < (2, 13):  # gloo had no list all_to_all: the same exchange
                flat = torch.empty(n * size, dtype=dtype)
                dist.all_to_all_single(flat, torch.cat([c.clone() for c in chunks]), group=g)
                outs = [flat[i * n : (i + 1) * n] for i in range(size)]
            else:
                dist.all_to_all(outs, [c.clone() for c in chunks], group=g)
            out[("all_to_all", *key)] = torch.stack(outs)
    return {k: v.contiguous() for k, v in out.items()}  # (tensors: lists of the large ones took seconds)


def hpdl_only_reductions(comm: Any) -> dict:
    """AVG and PREMUL_SUM (gloo has neither): the test compares them with SUM."""
    g = groups()["hpdl"]
    out = {}
    for n in SIZES:
        x = _data(dist.get_rank(), n, torch.float64)
        avg = x.clone()
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
        premul = x.clone()
        total = x.clone()
        dist.all_reduce(total, group=g)
        if not hasattr(dist._make_nccl_premul_sum(0.25), "factor"):  # torch < 2.13: the op's factor is hidden
            try:
                dist.all_reduce(premul, op=dist._make_nccl_premul_sum(0.25))
                out[n] = (avg.tolist(), "no error", total.tolist(), None, None)
            except ValueError as exc:
                out[n] = (avg.tolist(), str(exc), total.tolist(), None, None)
            continue
        dist.all_reduce(premul, op=dist._make_nccl_premul_sum(0.25))
        scattered = torch.empty(n, dtype=torch.float64)
        dist.reduce_scatter_tensor(
            scattered,
            _data(dist.get_rank(), n * dist.get_world_size(), torch.float64),
            op=dist.ReduceOp.PREMUL_SUM(0.5),
        )
        scattered_sum = torch.empty(n, dtype=torch.float64)
        dist.reduce_scatter_tensor(scattered_sum, _data(dist.get_rank(), n * dist.get_world_size(), torch.float64))
        out[n] = (avg.tolist(), premul.tolist(), total.tolist(), scattered.tolist(), scattered_sum.tolist())
    return out


def backend_capabilities(comm: Any) -> tuple:
    """What torch's Python code reads through `group._get_backend(device)` (torch 2.14's batch_isend_irecv)."""
    group = groups()["hpdl"]
    answers = []
    for device in ("cpu", torch.device("cpu"), "cuda:0"):
        backend = group._get_backend(device)
        answers.append((backend.name(), backend.supports_coalescing, backend.supports_tensor_alloc(device)))
    try:
        group._get_backend("meta")
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    return answers, refused


def async_and_objects(comm: Any, name: str) -> dict:
    """async_op with wait() and get_future(), coalesced calls, point-to-point, barrier and the object collectives."""
    g = groups()[name]
    rank, size = dist.get_rank(g), dist.get_world_size(g)
    out: dict = {}
    tensors = [_data(rank, n, torch.float32) for n in (3, 100000, 5)]
    works = [dist.all_reduce(t, group=g, async_op=True) for t in tensors]
    futures = [w.get_future() for w in works[1:]]
    works[0].wait()
    torch.futures.wait_all(futures)
    out["async"] = [t.tolist() for t in tensors]
    out["future value"] = [f.value()[0].tolist() for f in futures]
    chained = dist.all_reduce(torch.ones(4), group=g, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    out["then"] = chained.wait().tolist()
    # a small all_reduce issued async before a message the others need first: issuing it must not wait for them
    early = torch.full((2,), float(rank))
    if rank == 0:
        work = dist.all_reduce(early, group=g, async_op=True)
        for peer in range(1, size):
            dist.send(torch.ones(1), dst=peer, group=g, tag=9)
        work.wait()
    else:
        dist.recv(torch.empty(1), src=0, group=g, tag=9)
        dist.all_reduce(early, group=g)
    out["async, then a send the others wait for"] = early.tolist()
    coalesced = [_data(rank, n, torch.float64) for n in (4, 9, 1)]
    dist.all_reduce_coalesced(coalesced, group=g)
    out["all_reduce_coalesced"] = [t.tolist() for t in coalesced]
    # point-to-point: a ring, blocking and batched
    right, left = (rank + 1) % size, (rank - 1) % size
    received = torch.empty(6)
    if rank % 2 == 0:
        dist.send(torch.full((6,), float(rank)), dst=right, group=g)
        dist.recv(received, src=left, group=g)
    else:
        dist.recv(received, src=left, group=g)
        dist.send(torch.full((6,), float(rank)), dst=right, group=g)
    out["send/recv"] = received.tolist()
    big_in = torch.empty(300000)
    ops = [
        dist.P2POp(dist.isend, torch.full((300000,), float(rank)), right, group=g),
        dist.P2POp(dist.irecv, big_in, left, group=g),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["batch_isend_irecv"] = big_in[:3].tolist()
    # recv without src: rank 0 takes the others' messages in whatever order they come, and learns the sender
    if rank == 0:
        got = []
        for _ in range(size - 1):
            t = torch.empty(3)
            sender = dist.recv(t, group=g, tag=7)
            got.append((sender, t.tolist()))
        out["recv from any rank"] = sorted(got)
    else:
        dist.send(torch.full((3,), 10.0 * rank), dst=0, group=g, tag=7)
    dist.barrier(group=g)
    objects: list = [None] * size
    dist.all_gather_object(objects, {"rank": rank, "text": "x" * rank}, group=g)
    out["all_gather_object"] = objects
    chosen = [{"from": rank}, [rank] * 3] if rank == 0 else [None, None]
    dist.broadcast_object_list(chosen, src=0, group=g)
    out["broadcast_object_list"] = chosen
    gathered = [None] * size if rank == 0 else None
    dist.gather_object(("r", rank), gathered, dst=0, group=g)
    out["gather_object"] = gathered
    received_obj: list = [None]
    dist.scatter_object_list(received_obj, [f"to {j}" for j in range(size)] if rank == 0 else None, src=0, group=g)
    out["scatter_object_list"] = received_obj
    return out


def functional(comm: Any, name: str) -> dict:
    """The functional collectives (C++ dispatch through the process group, as DTensor uses them)."""
    import torch.distributed._functional_collectives as funcol

    g = groups()[name]
    rank = dist.get_rank(g)
    x = _data(rank, 12, torch.float32)
    return {
        "all_reduce": funcol.all_reduce(x, "sum", g).tolist(),
        "all_gather_tensor": funcol.all_gather_tensor(x, 0, g).tolist(),
        "reduce_scatter_tensor": funcol.reduce_scatter_tensor(x.repeat(dist.get_world_size(g)), "sum", 0, g).tolist(),
        "all_to_all_single": funcol.all_to_all_single(x.repeat(dist.get_world_size(g)), None, None, g).tolist(),
    }


_SUB: dict[str, Any] = {}


def subgroups(comm: Any) -> dict:
    """new_group on ranks [0, 1] (the last rank is outside on 3 ranks), for both backends; and DeviceMesh."""
    groups()
    rank = dist.get_rank()
    if not _SUB:
        _SUB["hpdl"] = dist.new_group([0, 1])
        _SUB["gloo"] = dist.new_group([0, 1], backend="gloo")
        _SUB["odd"] = dist.new_group([r for r in range(dist.get_world_size()) if r % 2 == 1] or [0])
        _SUB["hpdl again"] = dist.new_group([0, 1])
    out: dict = {}
    if rank in (0, 1):  # two groups' collectives issued in opposite orders on the two ranks: both complete
        a, b = torch.full((5,), rank + 1.0), torch.full((7,), 10.0 * (rank + 1))
        calls = [(a, _SUB["hpdl"]), (b, _SUB["hpdl again"])]
        works = [dist.all_reduce(t, group=g, async_op=True) for t, g in (calls if rank == 0 else calls[::-1])]
        for work in works:
            work.wait()
        out["opposite orders"] = (a.tolist(), b.tolist())
    for name in ("hpdl", "gloo"):
        g = _SUB[name]
        if rank in (0, 1):
            t = _data(rank, 9, torch.float64)
            dist.all_reduce(t, group=g)
            parts = [torch.empty(9, dtype=torch.float64) for _ in range(2)]
            dist.all_gather(parts, _data(rank, 9, torch.float64), group=g)
            b = _data(rank, 4, torch.float32)
            dist.broadcast(b, src=1, group=g)  # a global rank
            out[name] = (t.tolist(), [p.tolist() for p in parts], b.tolist(), dist.get_rank(g))
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=mesh.get_group("dp"))
    out["mesh"] = (t.tolist(), mesh.get_group("dp").__class__.__name__)
    return out


def reinit(comm: Any) -> tuple:
    """destroy_process_group and a second init_process_group in the same processes."""
    groups()
    dist.destroy_process_group()
    _GROUPS.clear()
    _SUB.clear()
    before = dist.is_initialized()
    g = groups()["hpdl"]
    t = torch.ones(2)
    dist.all_reduce(t, group=g)
    return before, t.tolist(), dist.get_backend()


# -------------------------------------------------------------------- failures
def skipped_calls(comm: Any, seconds: float) -> Optional[list]:
    """The last rank skips a new_group, then an all_reduce: each time the others get CommTimeoutError naming it."""
    import datetime

    g = groups()["hpdl"]
    g.comm.timeout = seconds
    if dist.get_rank() == dist.get_world_size() - 1:
        return None
    caught = []
    for call in (
        lambda: dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=seconds)),
        lambda: dist.all_reduce(torch.ones(3), group=g),
    ):
        try:
            call()
            caught.append(("returned", ""))
        except Exception as error:  # noqa: BLE001 - the test reads its type and message
            caught.append((type(error).__name__, str(error)))
    return caught


def mismatched_shapes(comm: Any) -> None:
    g = groups()["hpdl"]
    g.comm.debug = True
    try:
        dist.all_reduce(torch.ones(3 + dist.get_rank()), group=g)
    finally:
        g.comm.debug = False


def meeting_with_a_missing_rank(comm: Any, seconds: float) -> tuple:
    """The members of a new group meet (bounded) before MPI_Comm_create_group: rank 2 stays away once, then comes."""
    from mpi4py import MPI

    from hpdl.errors import CommTimeoutError
    from hpdl.interop.torch_backend.factory import meet

    meeting = MPI.COMM_WORLD.Dup()
    first = "came"
    if meeting.Get_rank() != 2:
        try:
            meet(meeting, [0, 1, 2], seconds)
            first = "returned"
        except CommTimeoutError as error:
            first = str(error)
    meeting.Barrier()  # rank 2 waits here until the others have given up
    # The same ranks and tag: no stale message may confuse this one. (Its bound is generous: on a loaded
    # machine, CI once saw all three ranks miss each other within 1 s here; the first meeting's timeout is
    # what this test is about.)
    meet(meeting, [0, 1, 2], 10 * seconds)
    meeting.Free()
    return first, "met"


def finishes_early(comm: Any) -> tuple:
    """Rank 0 destroys an hpdl group (as a script's end does) while the others call one more all_reduce on it."""
    import time

    groups()
    g = dist.new_group(backend="hpdl")
    dist.all_reduce(torch.ones(2), group=g)
    started = time.perf_counter()
    if dist.get_rank() == 0:
        dist.destroy_process_group(g)
        return time.perf_counter() - started, None
    try:
        dist.all_reduce(torch.ones(2), group=g)
        error = "returned"
    except Exception as exc:  # noqa: BLE001 - the type and message are what the test checks
        error = f"{type(exc).__name__}: {exc}"
    waited = time.perf_counter() - started
    dist.destroy_process_group(g)
    return waited, error


def blocking_calls_complete_on_return(comm: Any) -> dict:
    """The backend's process group called as torch calls it, asyncOp False and True, on 4 MiB: whether the
    returned work was complete before anyone waited, and the results (every rank's rank + 1, summed). The
    blocking call's tight loop may last 5 s here (10 ms by default, which 3 ranks on 2 busy cores can pass)."""
    from hpdl.interop.torch_backend import progress

    g = groups()["hpdl"]
    out = {}
    alone, progress.ALONE_SECONDS = progress.ALONE_SECONDS, 5.0
    try:
        for label, async_op in (("blocking", False), ("async", True)):
            for name in ("allreduce", "broadcast"):
                x = torch.full((1 << 20,), float(dist.get_rank() + 1))
                if name == "allreduce":
                    opts = dist.AllreduceOptions()
                    opts.reduceOp = dist.ReduceOp.SUM
                else:
                    opts = dist.BroadcastOptions()
                    opts.rootRank = dist.get_world_size() - 1
                opts.asyncOp = async_op
                work = getattr(g, name)([x], opts)
                complete = work.is_completed() if not async_op else None  # async: may or may not be, both are right
                work.wait()
                out[(label, name)] = (complete, float(x.min()), float(x.max()))
    finally:
        progress.ALONE_SECONDS = alone
    return out


def blocking_call_beside_another_thread(comm: Any) -> tuple:
    """Rank 0's main thread waits in a blocking all_reduce while its second thread sends what rank 1 must
    receive before rank 1 joins the all_reduce: the blocking call must not keep the other thread out."""
    import threading
    import time

    group = dist.distributed_c10d._get_default_group()
    groups()
    timeout, group.comm.timeout = group.comm.timeout, 20.0
    try:
        x, got = torch.ones(4), None
        if dist.get_rank() == 0:
            sender = threading.Thread(target=lambda: (time.sleep(0.3), dist.send(torch.full((4,), 7.0), dst=1)))
            sender.start()
            dist.all_reduce(x)
            sender.join()
        elif dist.get_rank() == 1:
            got = torch.empty(4)
            dist.recv(got, src=0)
            dist.all_reduce(x)
        else:
            dist.all_reduce(x)
        return x.tolist(), None if got is None else got.tolist()
    finally:
        group.comm.timeout = timeout


LATE_SECONDS = 0.5


def issue_order_with_a_late_rank(comm: Any) -> dict:
    """The last rank joins each case LATE_SECONDS late, so that the others' first collective is still in flight:

    - DDP's pattern: a second all_reduce is issued meanwhile; rank 0 times the issue (it starts at once, the
      caller goes on computing; the backend used to wait for the first one);
    - a future's callback issues a collective: on every rank it comes before the collective issued after
      `then` (it ran at once where the first was already complete); sizes differ, so another order raises;
    - a callback waits for a collective issued after the one it is attached to (it hung a queued design);
    - the same through `torch.futures.collect_all` (its callbacks are attached in C++);
    - a receive with a callback, pending while the group's next collective runs (the sender joins that first);
    - a sub-group is destroyed with two of its collectives in flight (a queued design ran its exit barrier
      against a collective on the other rank).
    """
    import time

    groups()
    rank, size = dist.get_rank(), dist.get_world_size()

    def value(n: int) -> torch.Tensor:
        if rank == size - 1:
            time.sleep(LATE_SECONDS / 4)  # (each case's total delay is about LATE_SECONDS)
        return torch.full((n,), float(rank + 1))

    out: dict = {}
    first, second = value(1000), value(3)
    time.sleep(LATE_SECONDS / 2 if rank == size - 1 else 0.0)
    one = dist.all_reduce(first, async_op=True)
    started = time.perf_counter()
    two = dist.all_reduce(second, async_op=True)
    out["issue seconds"] = time.perf_counter() - started
    two.wait()
    one.wait()
    out["in flight together"] = (first[:2].tolist(), second.tolist())

    a, b, c = value(5), value(3), value(7)
    work = dist.all_reduce(a, async_op=True)
    chained = work.get_future().then(lambda f: dist.all_reduce(b))
    dist.all_reduce(c)
    chained.wait()
    out["callback issues one"] = (a.tolist(), b.tolist(), c.tolist())

    x, y = value(4), value(6)
    w1, w2 = dist.all_reduce(x, async_op=True), dist.all_reduce(y, async_op=True)
    w1.get_future().then(lambda f: w2.wait()).wait()
    out["callback waits for a later one"] = (x.tolist(), y.tolist())

    d, e, h = value(9), value(5), value(7)
    works = [dist.all_reduce(d, async_op=True), dist.all_reduce(torch.ones(2), async_op=True)]
    collected = collect_all([w.get_future() for w in works]).then(lambda f: dist.all_reduce(e))
    dist.all_reduce(h)
    collected.wait()
    out["collect_all's callback issues one"] = (d.tolist(), e.tolist(), h.tolist())

    # a receive's callback holds no collective back: rank 0 waits in a collective before it sends
    got = torch.zeros(2)
    if rank == 1:
        received = dist.irecv(got, src=0)
        received.get_future().then(lambda f: None)
    f = value(3)
    dist.all_reduce(f)
    if rank == 0:
        dist.send(torch.full((2,), 7.0), dst=1)
    elif rank == 1:
        received.wait()
    out["receive's callback"] = (f.tolist(), got.tolist())

    # Blocking calls with nothing else in flight, the last rank late: the others' calls are still running after
    # the engine's short wait (`start_briefly` hands them back) and complete in the progress machinery.
    alone, rooted = value(3), value(2)
    dist.all_reduce(alone, op=dist.ReduceOp.MAX)
    dist.broadcast(rooted, src=size - 1)
    out["blocking, alone, a peer late"] = (alone.tolist(), rooted.tolist())

    # A callback waits for its own operation (torch's documented `fut.wait()` in a callback, and work.wait()):
    # it returns at once (found in review: both spun until the group's timeout).
    own = value(5)
    work = dist.all_reduce(own, async_op=True)
    own_future = work.get_future()
    waited = own_future.then(lambda f: f.wait()).then(lambda f, work=work: work.wait())
    started = time.perf_counter()
    waited.wait()
    out["callback waits for its own"] = (own.tolist(), time.perf_counter() - started < 5.0)

    # Operations finished in one batch of the thread that delivers them (the progress thread is kept busy
    # meanwhile by another group's callback, then the caller waits for the last one): the first one's callback
    # waits for the second, with work.wait() and with its future's wait(). Found in review: the wait spun until
    # the timeout, the future's hung for ever (only the thread blocked in the callback could deliver it).
    busy = dist.new_group(list(range(size)))
    for how in ("work", "future"):
        u, v, z = value(4), value(6), value(8)
        held = dist.all_reduce(torch.ones(2), group=busy, async_op=True)
        w1, w2, w3 = (dist.all_reduce(t, async_op=True) for t in (u, v, z))
        held.get_future().then(lambda f: time.sleep(0.1))
        waits = (lambda f, w2=w2: w2.wait()) if how == "work" else (lambda f, w2=w2: w2.get_future().wait())
        chained = w1.get_future().then(waits)
        time.sleep(0.2)  # computing: the progress thread completes what it can
        w3.wait()
        chained.wait()
        held.wait()
        out[f"same batch, {how}"] = (u.tolist(), v.tolist(), z.tolist())
    dist.destroy_process_group(busy)

    sub = dist.new_group(list(range(size)))
    p, q = value(2), value(8)
    works = [dist.all_reduce(p, group=sub, async_op=True), dist.all_reduce(q, group=sub, async_op=True)]
    dist.destroy_process_group(sub)
    for w in works:
        w.wait()
    out["destroyed in flight"] = (p.tolist(), q.tolist())
    return out


def a_callback_that_runs_too_long(comm: Any) -> tuple:
    """On rank 0 the progress thread runs a future's callback that takes 1.5 s, past its group's 0.5 s timeout;
    the main thread's `work.wait()` raises `CommTimeoutError` after about 0.5 s instead of waiting for it (every
    wait has a bound). The other ranks' all_reduce completes normally; the last rank joins only once rank 0 has
    attached the callback (a message on the world communicator says so), so that rank 0's operation is still in
    flight then and the progress thread runs it (a sleep there was not enough on a loaded machine: the future
    had completed, and torch ran the callback at once in the main thread)."""
    import threading
    import time

    from hpdl.errors import CommTimeoutError

    groups()
    rank, size = dist.get_rank(), dist.get_world_size()
    sub = dist.new_group(list(range(size)))
    sub.comm.timeout = 0.5
    if rank == size - 1:
        comm.recv(torch.zeros(1), 0, tag=7)  # rank 0 has attached its callback
    work = dist.all_reduce(torch.ones(3), group=sub, async_op=True)
    if rank != 0:
        work.wait()
        dist.destroy_process_group(sub)
        return None
    running, finished = threading.Event(), threading.Event()

    def slow(f: Any) -> None:
        running.set()
        time.sleep(1.5)
        finished.set()

    work.get_future().then(slow)
    comm.send(torch.ones(1), size - 1, tag=7)
    assert running.wait(5.0), "the progress thread did not run the callback"
    started = time.perf_counter()
    try:
        work.wait()
        error = None
    except CommTimeoutError as exc:
        error = str(exc)
    waited = time.perf_counter() - started
    finished.wait(5.0)
    dist.destroy_process_group(sub)
    return waited, error
