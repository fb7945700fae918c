"""With debug off, ranks that disagree on a collective's size, dtype or op get an error, not wrong values.

The mpi backend's agreement check (comm/agreement.py) compares every rank's
recent calls every `check_every` (16) collectives and at every barrier; a
receive sees a short message at once, and so does a two-rank collective that
travels as messages (comm/pairs.py) when the sizes differ. Each body makes
one mismatched call and then keeps calling matched collectives, as a
training loop would: the check's error must come within 16 calls, on every
rank, naming the ranks and sizes.
"""

from __future__ import annotations

import re

import pytest
import torch

from collective_data import SHM_FORCED
from conftest import RankError
from hpdl.errors import CollectiveMismatchError, CommError
from hpdl.runtime.spawn import local_mpiexec

CALLS_AFTER = 16  # the default check period: the error comes at the latest this many calls later


def mismatched(comm, kind):
    """(the error of the mismatched call itself, or ""; the agreement check's error, or "no error")"""
    assert not comm.debug and comm.check_every == CALLS_AFTER
    try:
        _mismatched_call(comm, kind)
    except CollectiveMismatchError as exc:  # the check ran at this very call
        return "", str(exc)
    except CommError as exc:
        return _then_the_check(comm, str(exc))
    return _then_the_check(comm, "")


def _then_the_check(comm, at_once):
    """(`at_once`, the agreement check's error within CALLS_AFTER matched calls, or "no error")"""
    try:
        for _ in range(CALLS_AFTER):
            comm.allreduce(torch.ones(1))
    except CollectiveMismatchError as exc:
        return at_once, str(exc)
    return at_once, "no error"


def _mismatched_call(comm, kind):
    last = comm.rank == comm.size - 1
    if kind == "allreduce size":
        comm.allreduce(torch.ones(1000 * (1 + last)))
    elif kind == "allreduce dtype":
        comm.allreduce(torch.ones(8, dtype=torch.int32 if last else torch.float32))
    elif kind == "allreduce op":
        comm.allreduce(torch.ones(8), op="max" if last else "sum")
    elif kind == "allgather dtype":
        comm.allgather(torch.ones(4, dtype=torch.int32 if last else torch.float32), sizes=[4] * comm.size)
    elif kind == "allgather sizes":
        n = 2 + last
        comm.allgather(torch.ones(n), sizes=[n] * comm.size, out=torch.zeros(n * comm.size))
    elif kind == "reduce_scatter op":
        comm.reduce_scatter(torch.ones(2 * comm.size), op="min" if last else "sum")
    elif kind == "broadcast dtype":
        comm.broadcast(torch.ones(4, dtype=torch.int32 if last else torch.float32), root=0)
    elif kind == "broadcast root":
        comm.broadcast(torch.ones(4), root=int(last))


def broadcast_of_different_sizes(comm, n):
    """MPICH fails a receiver whose count differs from the root's at once (in its own words); the root's call
    returns. The ranks go on, and the agreement check then names both calls on every rank."""
    try:
        comm.broadcast(torch.ones(n * (1 + (comm.rank == comm.size - 1))), root=0)
    except CommError as exc:
        return _then_the_check(comm, str(exc))
    return _then_the_check(comm, "")


def mismatched_off_the_check(comm, kind):
    if (comm._seq + 1) % CALLS_AFTER == 0:  # not where the periodic check runs
        comm.allreduce(torch.ones(1))
    return mismatched(comm, kind)


def probing_and_mismatched(comm, kind):
    return comm._probe_first, mismatched_off_the_check(comm, kind)


def barrier_after_mismatch(comm):
    try:
        comm.allreduce(torch.ones(3 + (comm.rank == 0)))
    except CollectiveMismatchError:
        raise
    except CommError as exc:  # two ranks: the messages' lengths differ
        assert "different sizes" in str(exc), exc
    comm.barrier()  # a barrier is a check too
    return "no error"


def shared_memory_sizes_differ(comm, mixed, op="allreduce"):
    """Two ranks on the shared-memory engine, tensors of 20,000 and 20,002 floats: views of shared buffers (each
    rank writes its sums into the other's buffer too), or with `mixed` an ordinary tensor on the last rank.
    (the error at the call, whether the tensors and the rest of the buffers kept their values, the check's error)"""
    last = comm.rank == comm.size - 1
    window = comm.shared_buffer(20_100)
    window.fill_(7.0)
    t = torch.full((20_002,), 7.0) if mixed and last else window[: 20_000 + 2 * last]
    try:
        if op == "allreduce":
            comm.allreduce(t)
        elif op == "reduce_scatter":
            comm.reduce_scatter(t)
        else:
            comm.broadcast(t, root=0)
        at_once = ""
    except CollectiveMismatchError as exc:
        at_once = str(exc)
    kept = bool(window.eq(7.0).all()) and bool(t.eq(7.0).all())
    return at_once, kept, _then_the_check(comm, at_once)[1]


def short_message(comm):
    if comm.rank == 0:
        comm.send(torch.ones(4), 1)
    elif comm.rank == 1:
        comm.recv(torch.zeros(8), 0)
    return "no error"


def long_message(comm):
    """A message longer than the receiving tensor, between tensors that must stay untouched."""
    if comm.rank == 0:
        comm.send(torch.ones(2000), 1)
        return "sent", True, True
    if comm.rank == 1:
        around = [torch.full((1000,), 7.0) for _ in range(20)]
        t = torch.zeros(1000)
        try:
            comm.recv(t, 0)
            error = "no error"
        except CommError as exc:
            error = str(exc)
        return error, bool(t.eq(0).all()), all(bool(a.eq(7).all()) for a in around)
    return "", True, True


def still_healthy(comm):
    return [comm.allreduce(torch.ones(2)).tolist() for _ in range(2 * CALLS_AFTER)][-1]


CASES = {
    "allreduce size": ("allreduce(float32, op=sum) on 4000 B", "allreduce(float32, op=sum) on 8000 B"),
    "allreduce dtype": ("allreduce(float32", "allreduce(int32"),
    "allreduce op": ("op=sum", "op=max"),
    "allgather dtype": ("allgather(float32)", "allgather(int32)"),
    "allgather sizes": ("4 rows in all", "6 rows in all"),
    "reduce_scatter op": ("op=sum", "op=min"),
    "broadcast dtype": ("broadcast(float32, root=0)", "broadcast(int32, root=0)"),
    "broadcast root": ("root=0", "root=1"),
}


AT_ONCE = {
    "allreduce size": ("this rank passed 4000 B, rank 1 sent ", "this rank passed 8000 B, rank 0 sent 4000 B"),
    "allgather sizes": ("this rank passed 8 B, rank 1 sent ", "this rank passed 12 B, rank 0 sent 8 B"),
}
"""Two ranks, sizes that differ: each rank's own words at the mismatched call (its messages' lengths differ). The
receiver of the longer message says "more than 4000 B" (MPI's truncation) or, where it probes first (outside
MPICH, or HPDL_PROBE_FIRST=1), "8000 B"."""


@pytest.mark.parametrize("kind", list(CASES))
def test_mismatch_is_an_error_within_the_check_period(ranks, kind):
    results = ranks("mpi", 2).run(mismatched, kind)
    for rank, (at_once, check) in enumerate(results):
        assert all(word in check for word in CASES[kind]), check
        assert re.search(r"\brank 0 called", check) and re.search(r"\brank 1 called", check)
        assert "HPDL_DEBUG=1" in check
        if kind in AT_ONCE and at_once:  # ("" where the check itself ran at the mismatched call)
            assert AT_ONCE[kind][rank] in at_once and "different sizes" in at_once, at_once
        elif kind not in AT_ONCE:
            assert at_once == "", at_once  # the same bytes on every rank: only the check can tell


@pytest.mark.parametrize(
    "env",
    [{}, {"HPDL_PROBE_FIRST": "1"}, {"HPDL_PROBE_FIRST": "1", "HPDL_COMPILED": "0"}],
    ids=["compiled", "probe", "mpi4py-probe"],
)
def test_sizes_that_differ_are_an_error_at_the_call_itself_on_two_ranks(ranks, env):
    """Two ranks (pairs.py): both ranks raise at the mismatched call, before its values reach the caller, and
    still agree on what comes next (the check then names both calls). Probing first, the receiver of the longer
    message knows its length and nothing lands past its buffer (Open MPI's truncation overruns it)."""
    pool = ranks("mpi", 2, env=env)
    for rank, (probed, (at_once, check)) in enumerate(pool.run(probing_and_mismatched, "allreduce size")):
        if env.get("HPDL_PROBE_FIRST") == "1" or local_mpiexec()[1] == "openmpi":
            assert probed
        longer = "rank 1 sent 8000 B" if probed else "rank 1 sent more than 4000 B"
        assert "allreduce #" in at_once and AT_ONCE["allreduce size"][rank] in at_once, at_once
        assert rank == 1 or longer in at_once, at_once
        assert "on 4000 B" in check and "on 8000 B" in check, check
    assert pool.run(still_healthy) == [[2.0, 2.0]] * 2


PROBING = [{}, {"HPDL_PROBE_FIRST": "1"}]
"""MPICH's receive at once, and the receive after a matched probe that Open MPI needs (and takes by default)."""


@pytest.mark.parametrize("env", PROBING, ids=["receive", "probe first"])
def test_sizes_that_differ_on_four_ranks_end_every_rank_without_a_hang(ranks, env):
    """Four ranks (recursive doubling over messages): the ranks that receive a message of the wrong length go on
    with their own values through every step, so that no rank waits forever, then raise; every rank's check
    names both calls within the period."""
    pool = ranks("mpi", 4, env=env)
    results = pool.run(mismatched_off_the_check, "allreduce size", timeout=60)
    for at_once, check in results:
        assert "on 4000 B" in check and "on 8000 B" in check, check
        assert at_once == "" or ("different sizes" in at_once and "allreduce #" in at_once), at_once
    assert sum(bool(at_once) for at_once, _ in results) >= 2  # the last rank and its first partner at least
    assert pool.run(still_healthy) == [[4.0, 4.0]] * 4


def test_barrier_checks_and_the_ranks_keep_working(ranks):
    pool = ranks("mpi", 2)
    for error in pool.run(barrier_after_mismatch, expect_errors=True):
        assert isinstance(error, RankError) and error.type_name == "CollectiveMismatchError", error
        assert "on 16 B" in error.message and "on 12 B" in error.message
    assert pool.run(still_healthy) == [[2.0, 2.0]] * 2


@pytest.mark.parametrize("mixed", [False, True], ids=["shared buffers", "one ordinary tensor"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "HPDL_COMPILED=0"])
def test_sizes_that_differ_on_the_shared_memory_engine_are_an_error_before_anything_is_written(ranks, mixed, compiled):
    """The engine's float sum reads the other ranks' tensors where they lie and, where every rank's tensor is in a
    shared buffer, writes into them: ranks whose tensors differ in length raise at the call, on every rank, with
    nothing changed (not a write past the shorter tensor into the memory after it), and go on. The same for a
    reduce_scatter and a broadcast, and on the engine's general route (no compiled module)."""
    pool = ranks("mpi", 2, SHM_FORCED if compiled else dict(SHM_FORCED, HPDL_COMPILED="0"))
    for op in ("allreduce", "reduce_scatter", "broadcast") if not mixed else ("allreduce",):
        for at_once, kept, check in pool.run(shared_memory_sizes_differ, mixed, op):
            assert f"{op} (shared memory)" in at_once and "rank 0: 20000, rank 1: 20002 elements" in at_once, at_once
            assert "no tensor was changed" in at_once and kept
            assert "80000 B" in check and "80008 B" in check, check
    assert pool.run(still_healthy) == [[2.0, 2.0]] * 2


@pytest.mark.parametrize("env", PROBING, ids=["receive", "probe first"])
def test_short_message_is_an_error_on_the_receiver(ranks, env):
    sent, received = ranks("mpi", 2, env=env).run(short_message, expect_errors=True)
    assert sent == "no error"
    assert isinstance(received, RankError) and received.type_name == "CommError", received
    assert "sent 16 B" in received.message and "8 x float32 (32 B)" in received.message


@pytest.mark.parametrize("env", PROBING, ids=["receive", "probe first"])
def test_long_message_is_an_error_on_the_receiver_and_writes_nothing_past_the_tensor(ranks, env):
    """Found on Open MPI 5.0.11: its truncation error came after it had written the whole message past the
    receiving tensor (`malloc(): invalid size`); there hpdl receives only after a probe told the length."""
    _, (error, tensor_untouched, others_untouched) = ranks("mpi", 2, env=env).run(long_message)
    assert error.startswith("recv from 0") and ("sent 8000 B" in error or "truncated" in error), error
    if env or local_mpiexec()[1] == "openmpi":  # the probe knows the length: the whole story, nothing written
        assert "sent 8000 B" in error and "nothing was written" in error and tensor_untouched, error
    assert others_untouched  # (MPICH may fill the tensor with the message's first 4000 B: allowed)


@pytest.mark.parametrize("n", [1000, 300_000])
def test_broadcast_of_different_sizes_fails_the_receiver_at_once_and_the_check_names_both(ranks, n):
    (root_at_once, root_check), (other_at_once, other_check) = ranks("mpi", 2).run(broadcast_of_different_sizes, n)
    assert root_at_once == ""  # the root's data went out: MPI does not fail its call
    if local_mpiexec()[1] in ("gforker", "hydra"):  # on Open MPI a receiver of fewer bytes returns: the check says
        assert "broadcast #" in other_at_once and "different sizes" in other_at_once, other_at_once
    for message in (root_check, other_check):
        assert f"broadcast(float32, root=0) on {4 * n} B" in message, message
        assert f"broadcast(float32, root=0) on {8 * n} B" in message, message


def wrong_turn(comm, scenario, prelude=False):
    """One rank takes a wrong turn on a fresh sub-communicator (it stays broken; the world goes on): `skipped` (rank 1
    skips an allreduce), `swapped` (rank 1 calls barrier, then allreduce) or `extra` (rank 1 calls an allgather
    more). `prelude`: a matched allreduce first (it starts the shared-memory engine where that is forced). The
    waits look at the peers after 0.2 s instead of 1 s (the same look, sooner: the test stays short).
    (the number of the diverging collective, the error's type, its message, the shared-memory engine's status)"""
    from hpdl.comm import work

    sub = comm.split(0)
    sub.timeout = 5.0
    x = torch.ones(1000)
    if prelude:
        sub.allreduce(x)
    at = sub._seq + 1 + (scenario == "extra")
    saved = work.SPIN_SECONDS, work.WATCH_SECONDS
    work.SPIN_SECONDS = work.WATCH_SECONDS = 0.2
    other = comm.rank == 1
    try:
        if scenario == "skipped":
            if not other:
                sub.allreduce(x)
            sub.barrier()
        elif scenario == "swapped":
            for call in (sub.barrier, lambda: sub.allreduce(x))[:: -1 if not other else 1]:
                call()
        else:
            sub.allreduce(x)
            if other:
                sub.allgather(x, sizes=[x.numel()] * comm.size)
            sub.barrier()
        return at, "no error", "", getattr(sub, "shm_status", "")
    except CommError as exc:
        return at, type(exc).__name__, str(exc), getattr(sub, "shm_status", "")
    finally:
        work.SPIN_SECONDS, work.WATCH_SECONDS = saved


WRONG_TURNS = {
    "skipped": ("allreduce", "barrier"),
    "swapped": ("allreduce", "barrier"),
    "extra": ("barrier", "allgather"),
}
"""What rank 0 and rank 1 called as the diverging collective."""


def _assert_true_story(results, scenario):
    """Each rank names what each rank is in, says they called different collectives, and names nothing the user did
    not call (the agreement check's allgather of 1536 B) nor claims every rank reached the collective."""
    first, second = WRONG_TURNS[scenario]
    for at, kind, message, _ in results:
        assert kind == "CollectiveMismatchError", (kind, message)
        assert f"rank 0 is in {first} #{at}; rank 1 is in {second} #{at}" in message, message
        assert f"the ranks called different collectives as their collective #{at}" in message, message
        assert "1536 B" not in message and "Every rank reached" not in message, message
        assert "different sizes" not in message, message


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_a_wrong_turn_names_what_every_rank_called(ranks, backend):
    """Skipped, swapped and extra collectives, debug off: both ranks say what each called, within a look at the
    progress board (before: on mpi, an allgather of 1536 B, the agreement check's exchange of rings, that had met
    the other rank's allreduce; on torch, after the whole timeout, "Every rank reached this collective")."""
    pool = ranks(backend, 2)
    started = __import__("time").perf_counter()
    for scenario in WRONG_TURNS:
        _assert_true_story(pool.run(wrong_turn, scenario, timeout=60), scenario)
    assert __import__("time").perf_counter() - started < 15  # well within the 5 s timeout each


def test_a_wrong_turn_on_the_shared_memory_engine_names_what_every_rank_called(ranks):
    pool = ranks("mpi", 2, SHM_FORCED)
    for scenario in WRONG_TURNS:
        results = pool.run(wrong_turn, scenario, True, timeout=60)
        _assert_true_story(results, scenario)
        assert all(status.startswith("on") for *_, status in results), results
    assert pool.run(still_healthy) == [[2.0, 2.0]] * 2


def test_the_progress_report_says_every_rank_reached_a_collective_only_when_it_did():
    from hpdl.comm.progress import describe_laggards

    same, _ = describe_laggards([(3, "allreduce"), (3, "allreduce")], 0, 3, "allreduce")
    assert "Every rank reached this collective" in same, same
    differ, missing = describe_laggards([(3, "allreduce"), (3, "barrier")], 0, 3, "allreduce")
    assert differ.startswith("rank 0 is in allreduce #3; rank 1 is in barrier #3: the ranks called different"), differ
    assert "Every rank reached" not in differ and missing == []
    behind, missing = describe_laggards([(3, "allreduce"), (2, "barrier"), None], 0, 3, "allreduce")
    assert "Did not arrive: rank 1" in behind and "Did not arrive: rank 2 (no progress report" in behind, behind
    assert missing == [1, 2]
    ahead, _ = describe_laggards([(3, "allreduce"), (4, "allreduce")], 0, 3, "allreduce")
    assert "Rank 1 went past #3 without this rank" in ahead and "Every rank reached" not in ahead, ahead
