"""Name-matched collectives with Horovod's agreement: what every operation of the Horovod API runs through.

Horovod matches collectives by name, not by call order: each rank submits
named requests, a coordinator runs a request once every rank has submitted
it, and it raises on every rank when the ranks disagree about it (shape,
dtype, op, root rank, scaling). hpdl does the same without a background
thread. A request is queued when submitted (`allreduce_async` returns at
once); when a rank has to wait (`synchronize`, a blocking op, `barrier`,
`join`), the members of the process set hold a *negotiation round*: one
small allgather of every rank's queued requests, each a short row of ints
(name hash, kind, op, dtype, shape, root, scale factors, ...). From that
table, which every rank reads identically, each rank

- launches, in one agreed order, the requests that every rank submitted
  and whose rows agree;
- fails, on every rank, the requests whose rows disagree (the error names
  the field, the values and the ranks);
- recognises a deadlock when a round can launch nothing although every
  member is waiting (each waits for a request another has not submitted):
  it raises at once on every rank, naming the requests and the ranks that
  lack them, where Horovod would stall.

The data collectives run on the set's own communicator, so their order is
the agreed one on every rank. Joined ranks (`join`) keep holding rounds and
answer allreduces with zeros until every rank has joined.

The rows fit one fixed-size exchange of ints in the common case (a second,
longer one is needed only when many requests are queued at once), so the
agreement costs one small collective per round.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from hpdl.comm.base import Communicator
from hpdl.comm.work import Work
from hpdl.errors import CommError
from hpdl.horovod import basics, process_sets, timeline
from hpdl.horovod.process_sets import ProcessSet, global_process_set

__all__: list[str] = []

ROW_WIDTH = 64
"""Ints per rank in a round's first allgather: the header and, in the common case, every queued row."""
HEADER = 6  # total length, joined, join round, number of requests, key hash this rank waits for, unnamed counter

KIND_NAMES = {
    1: "allreduce",
    2: "allgather",
    3: "broadcast",
    4: "alltoall",
    5: "reducescatter",
    6: "barrier",
    7: "process_set",
}
KINDS = {name: code for code, name in KIND_NAMES.items()}
DTYPES = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
DTYPE_CODES = {dtype: code for code, dtype in enumerate(DTYPES)}


def dtype_code(t: torch.Tensor, op: str) -> int:
    try:
        return DTYPE_CODES[t.dtype]
    except KeyError:
        raise ValueError(f"{op}: tensor type {t.dtype} is not supported") from None


def float_bits(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", float(x)))[0])


def bits_float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", int(bits)))[0])


_hashes: dict[str, int] = {}


def key_hash(key: str) -> int:
    """A stable 63-bit hash of an operation's name (Python's hash() differs between processes)."""
    h = _hashes.get(key)
    if h is None:
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True) or 1
        if len(_hashes) > 100_000:
            _hashes.clear()
        _hashes[key] = h
    return h


class Finish:
    """The finishing step of a launched request; `works` lets `poll` look without waiting."""

    def __init__(self, works: Sequence[Work], fn: Callable[[], Any]):
        self.works = list(works)
        self.fn = fn

    def __call__(self) -> Any:
        for w in self.works:
            w.wait()
        return self.fn()


@dataclass
class Request:
    """One named operation: its agreement row and how to run it once every rank agrees."""

    key: str
    kind: str
    common: list[int]
    """Must be equal on every rank (op, dtype, shape, root, ...)."""
    labels: list[tuple[str, Callable[[list[int]], Any]]]
    """How to show the common fields in an error: (label, decode(common) -> value)."""
    varying: list[int]
    """May differ between ranks (first dimensions, splits)."""
    launch: Callable[[Round, Request], Callable[[], Any]]
    """Start the data collective (every rank calls it in the same order); returns the finishing step."""
    process_set: ProcessSet
    supports_join: bool = False
    hash: int = 0
    finish: Optional[Callable[[], Any]] = None
    error: Optional[BaseException] = None
    result: Any = None
    done: bool = False
    submitted: float = field(default_factory=time.perf_counter)

    def row(self) -> list[int]:
        return [self.hash, KINDS[self.kind], len(self.common), *self.common, len(self.varying), *self.varying]


@dataclass
class Round:
    """What one negotiation round agreed, as each request's launcher needs it."""

    comm: Communicator
    rows: dict[int, dict[int, list[int]]]
    """key hash -> {member index: (common, varying) flattened as in Request.row}."""
    joined: list[bool]
    uniform: bool = False
    """Every rank's rows are equal (the fast path): varying fields are this rank's own."""

    def varying(self, key: int, own: Optional[list[int]] = None) -> list[Optional[list[int]]]:
        """Every member's varying fields of request `key` (None for a joined rank without it)."""
        if self.uniform:
            return [own] * self.comm.size
        by_rank = self.rows[key]
        out: list[Optional[list[int]]] = []
        for member in range(self.comm.size):
            row = by_rank.get(member)
            if row is None:
                out.append(None)
                continue
            n_common = row[2]
            out.append(row[4 + n_common :])
        return out


class _SetState:
    """The queued requests of one process set on this rank, and its round counter."""

    def __init__(self, ps: ProcessSet):
        assert ps.comm is not None
        self.ps = ps
        self.comm: Communicator = ps.comm
        self.queue: dict[int, Request] = {}  # by key hash, in submission order
        self.in_flight: dict[int, Request] = {}  # launched, not yet synchronized
        self.rounds = 0
        self.joined_at: Optional[int] = None
        self.noname = 0


_states: dict[int, _SetState] = {}
_handles: dict[int, Request] = {}
_next_handle = itertools.count(1)
stats = {"rounds": 0, "seconds": 0.0}
"""Negotiation rounds held and the seconds spent in them (the cost of the always-on agreement)."""


def reset() -> None:
    _states.clear()
    _handles.clear()


def forget(ps: ProcessSet) -> None:
    if ps.process_set_id is not None:
        _states.pop(ps.process_set_id, None)


process_sets.on_removal(forget)


def agree_on_change(key: str, ranks: list[int], change: Callable[[Communicator], None]) -> None:
    """Run `change(global communicator)` once every rank submitted the same process-set change `key`."""

    def launch(rnd: Round, req: Request) -> Callable[[], Any]:
        change(rnd.comm)
        return Finish([], lambda: None)

    labels = [("process set ranks", lambda common: common[1 : 1 + common[0]])]
    synchronize(submit(Request(key, "process_set", [len(ranks), *ranks], labels, [], launch, global_process_set)))


process_sets.agree_by(agree_on_change)


def state(ps: ProcessSet) -> _SetState:
    assert ps.process_set_id is not None
    st = _states.get(ps.process_set_id)
    if st is None or st.comm is not ps.comm:
        st = _states[ps.process_set_id] = _SetState(ps)
    return st


def make_key(kind: str, name: Optional[str], ps: ProcessSet) -> str:
    if name is None:
        st = state(ps)
        st.noname += 1
        return f"{kind}.noname.{st.noname}"
    return f"{kind}.{name}"


def submit(request: Request) -> int:
    """Queue `request` (Horovod's enqueue); returns its handle. Same name twice in flight: ValueError."""
    st = state(request.process_set)
    request.hash = key_hash(request.key)
    if request.hash in st.queue or (request.hash in st.in_flight and not st.in_flight[request.hash].done):
        raise ValueError(
            f"Requested to {request.kind} a tensor with the same name as another tensor that is currently being "
            f"processed: '{request.key}'. Give each operation in flight its own name."
        )
    st.queue[request.hash] = request
    handle = next(_next_handle)
    _handles[handle] = request
    if timeline.active():
        timeline.begin(request.key, "NEGOTIATE_" + request.kind.upper())
    return handle


def lookup(handle: int) -> Optional[Request]:
    return _handles.get(handle)


def poll(handle: int) -> bool:
    """Whether the request behind `handle` has finished (never waits, never negotiates)."""
    req = _handles.get(handle)
    if req is None:
        raise ValueError(f"handle {handle!r} is unknown or was already synchronized")
    if req.done:
        return True
    if req.finish is None:
        return False
    works = getattr(req.finish, "works", ())
    return all(w.is_completed() for w in works)


def synchronize(handle: int) -> Any:
    """Wait for the request behind `handle` (negotiating as needed) and return its result."""
    req = _handles.get(handle)
    if req is None:
        return None
    try:
        wait_for(req)
    finally:
        if req.done:
            _handles.pop(handle, None)
    if req.error is not None:
        raise req.error
    return req.result


def wait_for(req: Request) -> None:
    st = state(req.process_set)
    while req.finish is None and req.error is None:
        negotiate(st, waiting=req)
    complete(req)


def complete(req: Request) -> None:
    if req.done:
        return
    state(req.process_set).in_flight.pop(req.hash, None)
    if req.error is None:
        assert req.finish is not None
        try:
            req.result = req.finish()
        except CommError as exc:
            req.error = basics.internal_error(exc)
        if timeline.active():
            timeline.end(req.key)
    req.done = True


def join() -> int:
    """Horovod's join: answer the others' collectives (allreduce with zeros) until every rank joined.

    Returns the rank that joined last (the same on every rank).
    """
    st = state(global_process_set)
    st.joined_at = st.rounds
    try:
        while True:
            last = negotiate(st, waiting=None)
            if last is not None:
                return last
    finally:
        st.joined_at = None


def negotiate(st: _SetState, waiting: Optional[Request]) -> Optional[int]:
    """One round: exchange queued rows, launch what all ranks agree on, fail what they disagree on.

    Returns the last joined rank once every rank has joined (else None).
    """
    started = time.perf_counter()
    comm = st.comm
    queued = list(st.queue.values())
    message = [
        0,
        int(st.joined_at is not None),
        st.joined_at or 0,
        len(queued),
        waiting.hash if waiting else 0,
        st.noname,
    ]
    for req in queued:
        message.extend(req.row())
    message[0] = len(message)
    try:
        table = _exchange(comm, message)
    except CommError as exc:  # a timeout, a rank that finished: Horovod's error type, as for the data collectives
        raise basics.internal_error(exc) from exc
    st.rounds += 1
    if timeline.marking_cycles():
        timeline.instant("CYCLE_START")
    mine_row = table[comm.rank]
    if queued and not mine_row[1] and all(m == mine_row for m in table):
        # The common case: every rank queued the same requests with the same rows; all agree, all run.
        st.queue.clear()
        uniform = Round(comm, {}, [False] * comm.size, uniform=True)
        for req in queued:
            _launch(req, uniform)
        _account(started)
        return None
    joined = [bool(m[1]) for m in table]
    if all(joined):
        # Unnamed operations are numbered per rank; a joined rank did not number the ones it answered.
        st.noname = max(m[5] for m in table)
        order = sorted(range(comm.size), key=lambda r: (table[r][2], r))
        _account(started)
        return _world_rank(st.ps, order[-1])
    rows: dict[int, dict[int, list[int]]] = {}
    order_keys: list[int] = []
    for member, m in enumerate(table):
        pos = HEADER
        for _ in range(m[3]):
            n_common = m[pos + 2]
            n_vary = m[pos + 3 + n_common]
            end = pos + 4 + n_common + n_vary
            row = m[pos:end]
            rows.setdefault(row[0], {})[member] = row
            if row[0] not in order_keys:
                order_keys.append(row[0])
            pos = end
    ready = [k for k in order_keys if all(rows[k].get(r) is not None or joined[r] for r in range(comm.size))]
    rnd = Round(comm, rows, joined)
    progressed = False
    for k in ready:
        progressed = True
        mine = st.queue.pop(k, None)
        problem = _disagreement(rows[k], mine, comm)
        if problem is None and any(joined) and not _joinable(rows[k]):
            problem = (
                f"{KIND_NAMES[next(iter(rows[k].values()))[1]]} is not supported with hvd.join(): ranks "
                f"{[r for r in range(comm.size) if joined[r]]} have joined; only allreduce answers joined ranks"
            )
        if problem is not None:
            if mine is not None:
                mine.error = basics.HorovodInternalError(f"{mine.key}: {problem}")
                mine.done = True
            continue
        if mine is not None:
            _launch(mine, rnd)
        else:  # a joined rank answers with zeros
            _answer_joined(rnd, rows[k])
    _account(started)
    if not progressed:  # every member is in this round, waiting: nothing can change any more
        _deadlock(st, table, rows, joined, waiting)
    return None


def _launch(req: Request, rnd: Round) -> None:
    state(req.process_set).in_flight[req.hash] = req
    try:
        req.finish = req.launch(rnd, req)
    except Exception as exc:  # the engine refused it: fail the request, keep the others in step
        req.error = basics.internal_error(exc)
        req.done = True
    if timeline.active():
        timeline.end(req.key)
        timeline.begin(req.key, req.kind.upper())


def _account(started: float) -> None:
    stats["rounds"] += 1
    stats["seconds"] += time.perf_counter() - started


def _exchange(comm: Communicator, message: list[int]) -> list[list[int]]:
    """Every member's message: one fixed-size exchange, and a second one only when a message is longer.

    The exchange is an allreduce (sum) of a table in which each rank fills its own row: the same result
    as an allgather, on the engine's fastest small collective.
    """
    n, me = comm.size, comm.rank
    table = np.zeros((n, ROW_WIDTH), dtype=np.int64)
    head = message[:ROW_WIDTH]
    table[me, : len(head)] = head
    gathered = comm.allreduce(table, "sum").tolist()
    longest = max(g[0] for g in gathered)
    if longest <= ROW_WIDTH:
        return gathered
    lengths = [g[0] for g in gathered]
    full = np.zeros((n, longest), dtype=np.int64)
    full[me, : len(message)] = message
    rows = comm.allreduce(full, "sum").tolist()
    return [row[:length] for row, length in zip(rows, lengths)]


def _joinable(by_rank: dict[int, list[int]]) -> bool:
    kind = next(iter(by_rank.values()))[1]
    return KIND_NAMES[kind] in ("allreduce", "barrier")


def _disagreement(by_rank: dict[int, list[int]], mine: Optional[Request], comm: Communicator) -> Optional[str]:
    """A readable description of how the ranks' rows of one request differ (None when they agree)."""
    commons = {r: tuple(row[1 : 3 + row[2]]) for r, row in by_rank.items()}
    if len(set(commons.values())) <= 1:
        return None
    if mine is None:
        return "ranks disagree"
    mine_common = list(commons[comm.rank][2:]) if comm.rank in commons else None
    others = {r: list(c[2:]) for r, c in commons.items()}
    kinds = {r: c[0] for r, c in commons.items()}
    if len(set(kinds.values())) > 1:
        return "ranks ran different operations under one name: " + ", ".join(
            f"rank {r}: {KIND_NAMES.get(k, k)}" for r, k in sorted(kinds.items())
        )
    for label, decode in mine.labels:
        values = {}
        for r, c in others.items():
            try:
                values[r] = decode(c)
            except (IndexError, ValueError, KeyError):
                values[r] = "?"
        if len({repr(v) for v in values.values()}) > 1:
            listing = ", ".join(f"{v} on rank {r}" for r, v in sorted(values.items()))
            return f"mismatched {label} across ranks ({listing}); every rank must pass the same {label}"
    del mine_common
    return "ranks passed different arguments: " + ", ".join(f"rank {r}: {c}" for r, c in sorted(others.items()))


def _answer_joined(rnd: Round, by_rank: dict[int, list[int]]) -> None:
    """Run a request this (joined) rank did not submit: zeros for allreduce, an empty barrier."""
    row = next(iter(by_rank.values()))
    kind = KIND_NAMES[row[1]]
    common = row[3 : 3 + row[2]]
    if kind == "barrier":
        rnd.comm.barrier()
        return
    # allreduce common: op, prescale bits, postscale bits, n tensors, then (dtype, ndim, *shape) each
    op, n = common[0], common[3]
    pos, zeros = 4, []
    for _ in range(n):
        dtype, ndim = DTYPES[common[pos]], common[pos + 1]
        shape = common[pos + 2 : pos + 2 + ndim]
        zeros.append(torch.zeros(shape, dtype=dtype))
        pos += 2 + ndim
    engine_op = basics.ENGINE_OPS.get(op, "sum")
    if engine_op != "sum":
        raise basics.HorovodInternalError(
            f"hvd.join(): a joined rank cannot answer an allreduce with op={basics.op_name(op)} (only Sum/Average)"
        )
    for z in zeros:
        rnd.comm.allreduce(z, "sum")


def _deadlock(
    st: _SetState,
    table: list[list[int]],
    rows: dict[int, dict[int, list[int]]],
    joined: list[bool],
    waiting: Optional[Request],
) -> None:
    """Every member waits and no request can run: raise on every rank instead of waiting forever."""
    comm = st.comm
    names = comm.allgather_object({r.hash: r.key for r in st.queue.values()})
    known: dict[int, str] = {}
    for d in names:
        known.update(d)
    lines = []
    for member, m in enumerate(table):
        rank = _world_rank(st.ps, member)
        if joined[member]:
            lines.append(f"rank {rank} has joined")
            continue
        want = known.get(m[4], "?")
        missing = [
            _world_rank(st.ps, r) for r in range(comm.size) if rows.get(m[4], {}).get(r) is None and not joined[r]
        ]
        lines.append(f"rank {rank} waits for '{want}', which ranks {missing} have not submitted")
    message = (
        "collectives cannot be matched (every rank waits for an operation another rank has not submitted; "
        "Horovod would stall here): " + "; ".join(lines) + ". Every rank must submit the same named operations."
    )
    if waiting is not None:
        st.queue.pop(waiting.hash, None)
        waiting.error = basics.HorovodInternalError(message)
        waiting.done = True
        return
    raise basics.HorovodInternalError(message)


def _world_rank(ps: ProcessSet, member: int) -> int:
    return ps._ranks()[member]
