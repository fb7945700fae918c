"""Horovod's matching by name and its errors: mismatches raise on every rank, at once, and the ranks stay
in step; join answers the others' allreduces; process sets keep their collectives apart.

Every error case here would hang (or pair collectives wrongly) without the
agreement; each must end with a clear error well within the pool's timeout.
"""

from __future__ import annotations

import pytest
import torch


def expect(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the type and message are what the test checks
        return f"{type(exc).__name__}: {exc}"
    return None


def mismatch_body(comm):
    import hpdl.horovod as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    errors = {
        "shape": expect(lambda: hvd.allreduce(torch.ones(3 + r), name="shape")),
        "dtype": expect(lambda: hvd.allreduce(torch.ones(3, dtype=torch.int32 if r else torch.float32), name="dt")),
        "op": expect(lambda: hvd.allreduce(torch.ones(3), op=hvd.Sum if r else hvd.Max, name="op")),
        "root": expect(lambda: hvd.broadcast(torch.ones(2), root_rank=r, name="root")),
        "prescale": expect(lambda: hvd.allreduce(torch.ones(2), prescale_factor=1.0 + r, name="pre")),
        "allgather_tail": expect(lambda: hvd.allgather(torch.ones(2, 2 + r), name="tail")),
        "kind": expect(lambda: (hvd.allgather if r else hvd.allreduce)(torch.ones(2), name="kind")),
        # every rank waits for a name no other rank submits: Horovod stalls, hpdl raises at once
        "deadlock": expect(lambda: hvd.allreduce(torch.ones(2), name=f"only-on-{r}")),
    }
    if r == 0:  # a name twice in flight on one rank
        h = hvd.allreduce_async(torch.ones(2), name="twice")
        errors["duplicate"] = expect(lambda: hvd.allreduce_async(torch.ones(2), name="twice"))
    hvd.barrier()
    if r != 0:
        h = hvd.allreduce_async(torch.ones(2), name="twice")
    twice = hvd.synchronize(h)
    # named requests submitted in different orders still pair by name
    first, second = ("a", "b") if r % 2 else ("b", "a")
    handles = {name: hvd.allreduce_async(torch.tensor([float(ord(name) + r)]), op=hvd.Sum, name=name)
               for name in (first, second)}  # fmt: skip
    by_name = {name: float(hvd.synchronize(h)) for name, h in handles.items()}
    after = float(hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name="after"))
    return errors, float(twice.sum()), by_name, after, n


@pytest.mark.parametrize(("backend", "nprocs"), [("mpi", 2), ("mpi", 3), ("torch", 2)])
def test_mismatches_raise_on_every_rank_and_ranks_stay_in_step(ranks, backend, nprocs):
    results = ranks(backend, nprocs).run(mismatch_body)
    for r, (errors, twice, by_name, after, n) in enumerate(results):
        assert "mismatched shape" in errors["shape"] and "HorovodInternalError" in errors["shape"]
        assert "mismatched dtype" in errors["dtype"] and "int32" in errors["dtype"]
        assert "mismatched op" in errors["op"] and "Max" in errors["op"]
        assert "mismatched root_rank" in errors["root"]
        assert "mismatched prescale_factor" in errors["prescale"] and "2.0 on rank 1" in errors["prescale"]
        assert "past the first dimension" in errors["allgather_tail"]
        assert "cannot be matched" in errors["kind"] and "allgather.kind" in errors["kind"]
        assert "cannot be matched" in errors["deadlock"] and f"only-on-{r}" in errors["deadlock"]
        if r == 0:
            assert "ValueError" in errors["duplicate"] and "twice" in errors["duplicate"]
        assert twice == 2.0  # the average of ones
        assert by_name == {name: float(sum(ord(name) + k for k in range(n))) for name in "ab"}
        assert after == float(sum(range(n)))


def join_body(comm, caching):
    import hpdl.horovod as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    sums = []
    for step in range(r + 1):  # rank r has r + 1 batches: the others join earlier
        x = torch.full((3,), float(r + 1)) * (step + 1)
        sums.append(hvd.allreduce(x, op=hvd.Sum, name=f"grad.{step}" if caching else None).tolist())
    last = hvd.join()
    after = float(hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum))
    return sums, last, after, n


@pytest.mark.parametrize("caching", [True, False])
def test_join_answers_with_zeros_and_returns_the_last_rank(ranks, caching):
    n = 3
    results = ranks("mpi", n).run(join_body, caching)
    for sums, last, after, _ in results:
        assert last == n - 1
        assert after == float(n)
        for step, got in enumerate(sums):
            live = [k for k in range(n) if k >= step]  # ranks that still had a batch at this step
            assert got == [float(sum((k + 1) * (step + 1) for k in live))] * 3


def join_refusal_body(comm):
    import hpdl.horovod as hvd

    hvd.init()
    if hvd.rank() == 0:
        return hvd.join(), None
    error = expect(lambda: hvd.allgather(torch.ones(2)))
    return hvd.join(), error


def test_join_refuses_allgather_on_the_ranks_still_running(ranks):
    results = ranks("mpi", 2).run(join_refusal_body)
    assert results[0][0] == results[1][0] == 1
    assert "not supported with hvd.join()" in results[1][1]


def process_set_body(comm):
    import hpdl.horovod as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    evens = hvd.add_process_set([k for k in range(n) if k % 2 == 0])
    odds = hvd.add_process_set([k for k in range(n) if k % 2 == 1])
    mine, other = (evens, odds) if r % 2 == 0 else (odds, evens)
    out = {
        "sum": float(hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=mine)),
        "gather": hvd.allgather(torch.tensor([r]), process_set=mine).tolist(),
        "bcast": float(hvd.broadcast(torch.tensor([float(r)]), root_rank=mine.ranks[-1], process_set=mine)),
        "set_rank": mine.rank(),
        "set_size": mine.size(),
        "outside": expect(lambda: hvd.allreduce(torch.ones(1), process_set=other)),
        "duplicate": expect(lambda: hvd.add_process_set(list(mine.ranks))),
        "bad_root": expect(lambda: hvd.broadcast(torch.ones(1), root_rank=other.ranks[0], process_set=mine)),
    }
    hvd.barrier(mine)
    # a DistributedOptimizer on a set averages only within it
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), process_set=mine)
    model(torch.full((1, 2), float(r + 1), dtype=torch.float64)).sum().backward()
    opt.step()
    out["weight"] = model.weight.detach().clone()
    out["removed"] = (hvd.remove_process_set(odds), hvd.remove_process_set(evens), hvd.remove_process_set(odds))
    out["after_remove"] = expect(lambda: hvd.allreduce(torch.ones(1), process_set=mine))
    return out


def process_set_agreement_body(comm):
    import hpdl.horovod as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    # rank 1 still waits in a global allreduce while ranks 0 and 2 add a set: Horovod stalls; here every
    # rank raises, and the ranks are in step again afterwards
    if r == 1:
        out["out_of_step"] = expect(lambda: hvd.allreduce(torch.ones(2), name="late"))
    else:
        out["out_of_step"] = expect(lambda: hvd.add_process_set([0, 2]))
    out["different_ranks"] = expect(lambda: hvd.add_process_set([0, 1] if r == 0 else [0, 2]))
    pair = hvd.add_process_set([0, 2])
    if r in pair.ranks:
        out["sum"] = hvd.reducescatter(torch.arange(4.0) + r, op=hvd.Sum, process_set=pair).tolist()
    out["removed"] = hvd.remove_process_set(pair)
    out["after"] = float(hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name="after"))
    return out


def test_process_set_changes_are_agreed_like_named_operations(ranks):
    results = ranks("mpi", 3).run(process_set_agreement_body)
    for r, out in enumerate(results):
        assert "cannot be matched" in out["out_of_step"], out
        assert "add_process_set.1" in out["out_of_step"] and "allreduce.late" in out["out_of_step"]
        assert "mismatched process set ranks" in out["different_ranks"]
        assert "[0, 1] on rank 0" in out["different_ranks"] and "[0, 2] on rank 1" in out["different_ranks"]
        if r != 1:
            assert out["sum"] == [2.0 * k + 2 for k in range(r, r + 2)]
        assert out["removed"] is True
        assert out["after"] == 3.0


def test_process_sets(ranks):
    n = 3
    results = ranks("mpi", n).run(process_set_body)
    torch.manual_seed(0)
    w0 = torch.nn.Linear(2, 1).double().weight.detach()
    for r, out in enumerate(results):
        members = [k for k in range(n) if k % 2 == r % 2]
        assert out["sum"] == float(sum(members))
        assert out["gather"] == members
        assert out["bcast"] == float(members[-1])
        assert out["set_rank"] == members.index(r) and out["set_size"] == len(members)
        assert "not in ProcessSet" in out["outside"]
        assert "duplicate process set" in out["duplicate"]
        assert "is not in" in out["bad_root"]
        mean_input = sum(k + 1 for k in members) / len(members)
        assert torch.allclose(out["weight"], w0 - mean_input)
        assert out["removed"] == (True, True, False)
        assert "removed" in out["after_remove"]
