"""Connections between the ranks of one MPI job: set-up, ordered messages, close.

All traffic of the transport travels on one reserved tag of a communicator
(COMM_WORLD by default). Between two ranks that tag is an ordered stream
(MPI's non-overtaking rule), so many connections share it the way TCP
streams share a link: every message starts with a header naming its
connection (the initiator's connection id and which side sent it), and the
frames of a large message follow their header on the same stream, matched by
receives posted as soon as the header arrives (before the next probe). A
connection is therefore a pair of ranks plus an id; connecting sends CONNECT
to the listener's rank, which answers ACCEPT or REFUSE (no listener there).

Every incoming message is received at once, whether or not anyone reads the
connection yet (like a socket's receive buffer), so a sender never waits on
its reader and closing never leaves a send hanging. CLOSE is answered by
CLOSE; a side that has closed discards what still arrives for it.

A message reaches its reader in one wake-up, as over TCP: the sender's event
loop sends it (MPI_Isend, then it rings the receiver's doorbell, see
`hpdl.dask.doorbell`), and the receiver's event loop, woken by the doorbell,
receives it (matched probe and receive) and hands it to the connection. The
progress thread (`hpdl.dask.progress`) completes what needs MPI to progress
meanwhile (large frames) and polls for what no doorbell announced. CONNECT
and ACCEPT carry each side's doorbell address. Every step that calls MPI
holds the progress thread's lock, whichever thread takes it: a probe and the
receives of the frames that follow its header are one step, so no other
thread can match a frame as a header. That needs MPI_THREAD_MULTIPLE; with
MPI_THREAD_SERIALIZED the loops hand every step to the progress thread.

If the progress thread dies (an MPI error), every pending connect, send and
read fails with `TransportFailed` at once instead of waiting forever.

Only `Hub` touches MPI.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import itertools
import logging
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

from hpdl.dask import frames as wire
from hpdl.dask.doorbell import FETCHED, PUSH, BellAddress, Doorbell
from hpdl.dask.progress import Progress
from hpdl.errors import HpdlError
from hpdl.runtime.memory import keep_freed_memory

__all__ = ["Channel", "Hub", "MPITransportError", "TransportFailed", "get_hub", "parse_location"]

logger = logging.getLogger(__name__)
Frames = list[memoryview]
FRAMES_SPIN = 2e-3
"""Seconds a rung loop keeps completing the frames of the messages it found (a copy inside MPI, like a socket
read: MiBs in this time); larger ones are left to the progress thread (one more wake-up when they complete)."""
FALLBACK_POLL = 10e-3
"""While a loop waits on the doorbell, the progress thread probes for unannounced messages after this many seconds
without a ring (a CONNECT from a rank that does not know this one yet waits that long at most)."""
RECEIVE_SECONDS = 60.0
"""How long the rest of a message may take to arrive once its start has (see `Hub._finish_receive`)."""
RECEIVE_HOT = 0.1
"""For this long the rest is tested every 10 us; then less and less often (a 4 MiB inline message crosses a
1 Gbit/s link in 35 ms)."""
RETRY_SECONDS = 5e-3
"""How long a loop keeps looking, at each of its turns, for a message whose ring came first (over a network)."""
PUSH_AFTER = 1e-3
"""Seconds a large message's frames may take to arrive before the receiver asks its sender for a push (see
`Hub._watch_sent`): over shared memory with single-copy transfers the receiver's first test copies them whole."""
EOF = None
"""What a channel's inbox yields after the last message of a closed connection."""


class MPITransportError(HpdlError):
    """The mpi:// transport cannot work here (MPI thread level, address of another job, stopped hub)."""


class TransportStopped(MPITransportError, ConnectionError):
    """The process is exiting: like a refused connection to distributed (an OSError), so nothing retries forever."""


class TransportFailed(MPITransportError, ConnectionError):
    """The progress thread died (its error is the cause): this process's mpi:// connections are gone."""


def _transport_failed(error: BaseException) -> BaseException:
    failure = TransportFailed(
        f"the mpi:// progress thread failed ({error!r}): this process's mpi:// connections are gone; "
        "see the log for its traceback"
    )
    failure.__cause__ = error
    return failure


def parse_location(loc: str) -> tuple[int, str]:
    """`"<rank>:<id>"` -> (rank, id); the id may be empty (any free id, when listening)."""
    rank_text, _, ident = loc.partition(":")
    try:
        rank = int(rank_text)
    except ValueError:
        raise ValueError(f"mpi:// address {loc!r}: expected mpi://<rank>:<id>, e.g. mpi://0:1") from None
    return rank, ident


@dataclass
class Inbox:
    """The event-loop side of a connection: received messages in order, and at most one waiting reader."""

    loop: asyncio.AbstractEventLoop
    messages: list[Optional[Frames]] = field(default_factory=list)
    waiter: Optional[asyncio.Future[Optional[Frames]]] = None
    peer_closed: bool = False
    failed: Optional[BaseException] = None
    """Set when the transport has died: reads after the last received message raise it."""
    handed: int = 0
    """Messages queued to the loop by `deliver` (counted under the hub's lock)..."""
    taken: int = 0
    """... and how many of them the loop has run (counted on the loop): equal, none is pending."""

    def deliver(self, message: Optional[Frames]) -> None:  # any thread, under the hub's lock
        """Hand a message to the reader: at once on the loop's own thread when nothing handed over earlier is still
        queued (a turn of the loop less per message), else queued behind what is (the order stays)."""
        if self.handed == self.taken and asyncio._get_running_loop() is self.loop:
            self.put(message)
            return
        self.handed += 1
        _call(self.loop, functools.partial(self._put_queued, message))

    def _put_queued(self, message: Optional[Frames]) -> None:
        self.taken += 1
        self.put(message)

    def put(self, message: Optional[Frames]) -> None:  # on the loop
        if message is EOF:
            self.peer_closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(message)
            self.waiter = None
        else:
            self.messages.append(message)

    async def get(self) -> Optional[Frames]:
        if self.messages:
            return self.messages.pop(0)
        if self.failed is not None:
            raise self.failed
        if self.waiter is not None:
            raise RuntimeError("mpi:// connection: only one reader at a time")
        self.waiter = self.loop.create_future()
        try:
            return await self.waiter
        finally:
            self.waiter = None

    def interrupt(self, error: BaseException) -> None:
        """Fail a waiting reader (this side closed the connection, as closing a socket does)."""
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)

    def fail(self, error: BaseException) -> None:
        """The transport has died: fail the waiting reader and every later read (on the loop)."""
        self.failed = error
        self.interrupt(error)

    def at_eof(self) -> bool:
        return bool(self.messages) and self.messages[0] is EOF


@dataclass(eq=False)
class Arrival:
    """A message whose frames may still be arriving: its receives, its frames (None: the peer's CLOSE)."""

    requests: list[Any]
    views: Optional[Frames]
    since: float = 0.0
    asked: bool = False
    """Whether the sender has been asked for a push for it."""


@dataclass(eq=False)
class Channel:
    """One connection's state on the progress thread."""

    peer: int
    cid: int
    initiator: bool
    inbox: Optional[Inbox] = None
    local_closed: bool = False
    peer_closed: bool = False
    receiving: list[Arrival] = field(default_factory=list)
    """Messages whose frames are still arriving, oldest first (delivered in order)."""

    @property
    def key(self) -> tuple[int, int, bool]:
        return (self.peer, self.cid, self.initiator)

    @property
    def side(self) -> int:
        return 1 if self.initiator else 0


@dataclass
class ListenerEntry:
    loop: asyncio.AbstractEventLoop
    on_channel: Callable[[Channel], None]
    """Called on `loop` with each accepted channel (its inbox already set)."""


class Hub:
    """This process's end of the transport: listeners, channels, and the protocol on the progress thread."""

    def __init__(self, comm: Any = None, tag: Optional[int] = None) -> None:
        from mpi4py import MPI

        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
        level = MPI.Query_thread()
        if level < MPI.THREAD_SERIALIZED:
            raise MPITransportError(
                f"mpi:// needs MPI initialised with at least MPI_THREAD_SERIALIZED (got level {level}): "
                "leave mpi4py.rc.thread_level at its default ('multiple') or set it to 'serialized'"
            )
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        tag_ub = self.comm.Get_attr(MPI.TAG_UB) or 32767
        self.tag = tag if tag is not None else tag_ub - 0x4D  # a fixed tag near the top, the same on every rank
        self.thread_level = level
        self.hostname = MPI.Get_processor_name() or socket.gethostname()
        self.hosts: dict[int, str] = {}
        """rank -> host name, where known (`set_hosts`); else ranks count as hosts of their own."""
        self.chunk = wire.chunk_bytes()
        self.inline = wire.inline_limit()
        self._listeners: dict[str, ListenerEntry] = {}
        self._listener_ids = itertools.count(1)
        self._cids = itertools.count(1)
        self._channels: dict[tuple[int, int, bool], Channel] = {}
        self._connecting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Channel]]] = {}
        self._arriving: set[Channel] = set()
        """Channels with messages not yet delivered."""
        self._status = MPI.Status()
        self.direct = level >= MPI.THREAD_MULTIPLE
        """Whether event loops call MPI themselves (under the lock); else every step runs on the progress thread."""
        self.doorbell = Doorbell()
        self._bells: dict[int, BellAddress] = {}
        """rank -> its doorbell, learnt at connection set-up."""
        self._bell_loop: Optional[asyncio.AbstractEventLoop] = None
        keep_freed_memory()  # the inline copies on fresh pages cost more than the messages themselves
        self.progress = Progress(failure=_transport_failed)
        self.lock = self.progress.lock
        self.progress.in_flight = lambda: bool(self._arriving) or (self._retry_until == 0.0 and self._owed())
        self._next_poll = 0.0
        self._retry_until = 0.0
        self._rung = 0.0
        self._abandoned: list[tuple[Any, np.ndarray]] = []
        """Receives given up on (`_finish_receive`) and their buffers, which MPI may still fill."""
        self._pushed: set[int] = set()
        """Ranks whose pending sends from here need this process's MPI progress (see `_watch_sent`)."""
        self._sent: dict[int, int] = {}
        """rank -> messages sent to it that it probes for (the count each ring carries)."""
        self._received: dict[int, int] = {}
        """rank -> messages received from it by a probe..."""
        self._announced: dict[int, int] = {}
        """... and how many its rings said it had sent: more than received, one is still on its way."""
        self._fallback_interval = max(self.progress.backoff.cap, FALLBACK_POLL)
        """Seconds between the progress thread's probes while a loop waits on the doorbell (`_background_poll`)."""
        self.progress.idle_cap = self._idle_cap
        self.progress.add_poller(self._background_poll)
        self.progress.add_failure_handler(self._on_failure)

    # ---------------------------------------------------------------- addresses
    def host_of(self, rank: int) -> str:
        if rank == self.rank:
            return self.hostname
        return self.hosts.get(rank, f"mpi-rank-{rank}")

    def set_hosts(self, hosts: list[str]) -> None:
        """Every rank's host name (from an allgather at cluster start): same-host ranks then count as such."""
        self.hosts = dict(enumerate(hosts))

    def check_rank(self, rank: int, address: str) -> None:
        if not 0 <= rank < self.size:
            raise MPITransportError(
                f"{address}: rank {rank} is not in this MPI job (ranks 0..{self.size - 1}): mpi:// connects only "
                "processes of one mpiexec job; use tcp:// for anything outside it"
            )

    # ---------------------------------------------------------------- listeners (any thread)
    def listen(self, ident: str, loop: asyncio.AbstractEventLoop, on_channel: Callable[[Channel], None]) -> str:
        """Register a listener and return its id (a fresh one when `ident` is empty or "0")."""

        if ident and not ident.isdigit():
            raise ValueError(f"mpi://{self.rank}:{ident}: a listener id is a number (or empty, or 0, for any free id)")

        def op() -> str:
            name = ident if ident not in ("", "0") else str(next(self._listener_ids))
            if name in self._listeners:
                raise OSError(f"mpi://{self.rank}:{name} is already listening")
            self._listeners[name] = ListenerEntry(loop, on_channel)
            return name

        self._attach_doorbell(loop)
        return self.progress.call(op)

    def unlisten(self, ident: str) -> None:
        try:
            self.progress.submit(lambda: self._listeners.pop(ident, None))
        except TransportFailed:  # nothing listens any more
            pass

    # ---------------------------------------------------------------- connections (event loop)
    async def connect(self, rank: int, ident: str) -> Channel:
        """Open a connection to listener `ident` on `rank`; ConnectionRefusedError if there is none (yet)."""
        loop = asyncio.get_running_loop()
        self._attach_doorbell(loop)
        future: asyncio.Future[Channel] = loop.create_future()
        self.progress.submit(
            functools.partial(_guarded, loop, future, self._start_connect, rank, ident, loop, future),
            on_error=functools.partial(_reject, loop, future),
        )
        return await future

    def send(self, channel: Channel, views: Frames, loop: asyncio.AbstractEventLoop) -> asyncio.Future[int]:
        """Send one message (its frames); the future is done once MPI has every buffer (they may be reused).

        On this thread, now: an inline message is copied and usually complete before this returns."""
        future: asyncio.Future[int] = loop.create_future()
        if channel.peer == self.rank:
            self._send_here(channel, views, future)
            return future
        if not self.direct:
            self.progress.submit(
                functools.partial(_guarded, loop, future, self._send, channel, views, loop, future),
                on_error=functools.partial(_reject, loop, future),
            )
            return future
        with self.lock:
            if self.progress.error is not None:
                raise self.progress.failure(self.progress.error)
            self.progress.test_groups()  # earlier sends progress too (the progress thread may wait for the GIL)
            self._send(channel, views, loop, future)
        return future

    def close(self, channel: Channel) -> None:
        try:
            if self.direct and self.progress.error is None:
                with self.lock:
                    self._close(channel)
            else:
                self.progress.submit(lambda: self._close(channel))
        except TransportFailed:  # the transport is gone, and the connection with it
            pass

    # ---------------------------------------------------------------- the doorbell (event loop)
    def _attach_doorbell(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait on the doorbell in `loop` (the first loop that listens or connects; again after it has closed)."""
        current = self._bell_loop
        if current is loop or (current is not None and not current.is_closed()):
            return
        self._bell_loop = loop
        for fd in self.doorbell.filenos():
            loop.add_reader(fd, self._on_doorbell, fd)

    def _on_doorbell(self, fd: int) -> None:
        """A peer has sent this process something: receive it now, in this loop's thread."""
        rings = self.doorbell.drain(fd)
        with self.lock:  # the rings' counts and the receive they announce in one step: else the progress thread
            # can see a message owed in between, probe for it itself, and hand it over with one more wake-up
            for rank, sent in rings.counts.items():
                if sent > self._announced.get(rank, 0):
                    self._announced[rank] = sent
            for rank in rings.pushes:  # a receiver waits for this process to move what it sends there
                self._pushed.add(rank)
                self.progress.heat(rank)
            if not self.direct or self.progress.error is not None:
                self.progress.kick()  # its tick tests the sends that peers have fetched, too
                return
            self._rung = time.monotonic()
            self._receive_now()  # it tests every watched send first: those a FETCHED ring announced complete
            if self._owed() and self._retry_until <= self._rung:
                # rung before MPI showed a message (queued sends on shared memory, a network): look again at each
                # turn of the loop for a while
                self._retry_until = self._rung + RETRY_SECONDS
                asyncio.get_running_loop().call_soon(self._retry)

    def _receive_now(self) -> bool:
        """Receive what has arrived and complete its frames for up to FRAMES_SPIN; whether anything was found."""
        with self.lock:
            if self.progress.error is not None:
                return True
            self.progress.test_groups()
            try:
                found = self._poll_locked()
            except MPITransportError as error:  # a sender stopped mid-message: end the transport, as the thread
                self.progress.submit(functools.partial(_raise, error))  # does for its own errors (every waiter
                return True  # gets TransportFailed)
            deadline = time.perf_counter() + FRAMES_SPIN
            while found and self._arriving and time.perf_counter() < deadline:
                self._complete()
            if self._arriving:
                self.progress.kick()  # large frames still arriving: the progress thread completes them
            return found

    def _retry(self) -> None:
        """While a ring announced more messages than have shown up: probe again at each turn of the loop, for at
        most RETRY_SECONDS (then the progress thread's poll finds them)."""
        self._receive_now()
        if not self._owed():
            self._retry_until = 0.0
        elif time.monotonic() < self._retry_until:
            asyncio.get_running_loop().call_soon(self._retry)
        else:
            self._retry_until = 0.0
            self.progress.kick()

    def _owed(self) -> bool:
        """Whether a ring announced a message that no probe has received yet."""
        received = self._received
        return any(sent > received.get(rank, 0) for rank, sent in self._announced.items())

    def _background_poll(self) -> bool:
        """The progress thread's poll: frames in flight at every tick; new messages, while a loop waits on the
        doorbell (which announces them), only when no ring came for a poll interval, once per interval (a CONNECT
        from a rank that does not know this one yet, a lost datagram). Probing more often would take messages from
        the loop: one more wake-up each."""
        with self.lock:
            busy = self._complete() if self._arriving else False
            now = time.monotonic()
            loop = self._bell_loop
            if loop is not None and loop.is_running() and not (self._retry_until == 0.0 and self._owed()):
                if now < self._next_poll or now - self._rung < self._fallback_interval:
                    return busy
                self._next_poll = now + self._fallback_interval
            return self._poll_locked() or busy

    def _idle_cap(self) -> float:
        """While a loop waits on the doorbell, nothing needs the progress thread before its next fallback poll:
        sleeping until then spares the loops a GIL hand-over every millisecond (5-10% of a small message's time,
        over tcp:// as well as mpi://, in the same process)."""
        loop = self._bell_loop
        if self.direct and loop is not None and loop.is_running():
            return self._fallback_interval
        return self.progress.backoff.cap

    async def wait_request(self, start: Callable[[], Any]) -> None:
        """Start a non-blocking MPI operation on the progress thread (e.g. `lambda: comm.Ibarrier()`) and await it.

        A blocking collective on the progress thread would stop this rank's
        transport (no connection could be accepted while it waits)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        reject = functools.partial(_reject, loop, future)

        def op() -> None:
            self.progress.watch([start()], functools.partial(_resolve, loop, future), on_error=reject, hot=False)

        self.progress.submit(functools.partial(_guarded, loop, future, op), on_error=reject)
        await future

    # ---------------------------------------------------------------- progress thread
    def _isend(self, buffer: Any, dest: int) -> Any:
        return self.comm.Isend([buffer, self.MPI.BYTE], dest=dest, tag=self.tag)

    def _ring(self, dest: int, count: int) -> None:
        """Ring `dest`'s doorbell, if known, with a count of messages sent to it, or PUSH or FETCHED."""
        bell = self._bells.get(dest)
        if bell is not None:
            self.doorbell.ring(bell, self.rank, count)

    def _ask_push(self, source: int) -> None:
        self._ring(source, PUSH)

    def _fetched(self, source: int) -> None:
        """A large message from `source` has arrived whole: its sender may complete the send (see `_needs_push`)."""
        self._ring(source, FETCHED)

    def _isend_rung(self, buffer: Any, dest: int, frames: Sequence[Any] = ()) -> list[Any]:
        """Send a message that the receiver probes for (a header, an inline message, a control message), counted,
        and the frames that follow it; then ring `dest` with the count (once every frame is under way: a receiver
        that woke between them would find its frames missing and ask for a push). Returns every request."""
        requests = [self._isend(buffer, dest)] + [self._isend(frame, dest) for frame in frames]
        sent = self._sent[dest] = self._sent.get(dest, 0) + 1
        self._ring(dest, sent)
        return requests

    def _control(self, dest: int, header: np.ndarray) -> None:
        (request,) = self._isend_rung(header, dest)
        if not request.Test():
            self.progress.watch([request], _nothing, keep=header)
            self.progress.kick()

    def _start_connect(
        self, rank: int, ident: str, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Channel]
    ) -> None:
        try:
            listener = int(ident)
        except ValueError:
            _resolve(loop, future, error=ValueError(f"mpi://{rank}:{ident}: the listener id must be an integer"))
            return
        if rank == self.rank:
            self._connect_here(listener, loop, future)
            return
        cid = next(self._cids)
        self._connecting[cid] = (loop, future)
        with self.lock:
            self._control(rank, wire.pack_header(wire.Kind.CONNECT, cid, 1, listener, *self.doorbell.address.words()))

    def _send(
        self, channel: Channel, views: Frames, loop: asyncio.AbstractEventLoop, future: asyncio.Future
    ) -> Optional[list[Any]]:
        """Start sending; the requests the caller may test while the future is not done (else None)."""
        if channel.local_closed or channel.peer_closed:
            from distributed.comm.core import CommClosedError

            _resolve(loop, future, error=CommClosedError(f"mpi:// connection to rank {channel.peer} is closed"))
            return None
        total = sum(v.nbytes for v in views)
        if total <= self.inline:
            buffers: list[Any] = [wire.pack_inline(channel.cid, channel.side, views)]
        else:
            header = wire.pack_header(wire.Kind.DATA, channel.cid, channel.side, len(views), *(v.nbytes for v in views))
            buffers = [header] + [v[a:b] for v in views for a, b in wire.chunks(v.nbytes, self.chunk)]
        requests = self._isend_rung(buffers[0], channel.peer, buffers[1:])
        done = self.MPI.Request.Testall(requests)
        if done or total <= self.inline:
            # MPI holds the bytes already, or the one buffer is this transport's own copy: the caller's frames are
            # free at once (like a socket's send buffer); the copy stays referenced until MPI has sent it
            if not done:
                self._watch_sent(channel.peer, requests, buffers)
            if asyncio._get_running_loop() is loop:
                future.set_result(total)  # awaited without a turn of the loop
            else:
                _resolve(loop, future, total)
            return None
        self._watch_sent(
            channel.peer,
            requests,
            buffers,
            functools.partial(_resolve, loop, future, total),
            functools.partial(_reject, loop, future),
        )
        return requests

    def _watch_sent(
        self,
        peer: int,
        requests: list[Any],
        buffers: list[Any],
        on_done: Optional[Callable[[], None]] = None,
        on_error: Optional[Callable[[BaseException], None]] = None,
    ) -> None:
        """Keep a message's buffers until MPI has sent it (hot where it needs this process's MPI calls; else the
        receiver's FETCHED ring, the loops' own MPI calls or the back-off's tick complete it)."""
        hot = self._needs_push(peer)
        self.progress.watch(requests, on_done or _nothing, keep=buffers, on_error=on_error, hot=hot, key=peer)
        if hot:
            self.progress.kick()

    def _needs_push(self, peer: int) -> bool:
        """Whether sends to `peer` need this process's MPI calls to finish, and are polled hot.

        With a single-copy transfer (MPICH's CMA from 8 KiB on one host) the
        receiver reads the copy itself, and the send completes at this
        process's next MPI call after the receiver's acknowledgement: the
        loops' own calls (every send and receive tests the watched groups) or
        the progress thread's back-off tick. Hot polling for it instead took
        the GIL from the loops every 10 us: a 64 KiB message 1.6x slower (259
        against 157 us; tcp:// 163). Without such a path the receiver cannot
        finish until this process moves the rest of the message: sends to
        another host are polled hot from the start (over a network MPI may not
        even show the message before its sender's next call); on this host
        (CMA off) the receiver asks for a push (a PUSH ring), which
        heats the pending sends to it and marks it, so that its later sends
        are polled hot from the start. A large message's receiver says when
        it has taken it (a FETCHED ring): that ring's handler tests
        the sends, so the writer awaiting one is not left to the back-off."""
        bell = self._bells.get(peer)
        return peer in self._pushed or bell is None or not self.doorbell.is_local(bell)  # another host: no such path

    def _connected(self, channel: Channel, future: asyncio.Future[Channel]) -> None:
        """On the connecting loop: a cancelled connect (timeout) closes the connection again."""
        if future.cancelled():
            self.close(channel)
        else:
            future.set_result(channel)

    def _close(self, channel: Channel) -> None:
        if channel.local_closed:
            return
        channel.local_closed = True
        if channel.peer == self.rank:
            self._close_here(channel)
            return
        self._control(channel.peer, wire.pack_header(wire.Kind.CLOSE, channel.cid, channel.side))
        if channel.peer_closed:
            self._channels.pop(channel.key, None)

    # ---------------------------------------------------------------- connections within this process
    # Both ends here (a worker's shuffle sends to itself through its own address): nothing crosses MPI, whose path
    # from a process to itself moved a 15 MB frame only at this process's MPI calls, in 2 to 65 ms.

    def _connect_here(self, listener: int, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Channel]) -> None:
        entry = self._listeners.get(str(listener))
        if entry is None:
            _resolve(loop, future, error=ConnectionRefusedError(f"no mpi:// listener at mpi://{self.rank}:{listener}"))
            return
        cid = next(self._cids)
        mine, theirs = Channel(self.rank, cid, True), Channel(self.rank, cid, False)
        mine.inbox, theirs.inbox = Inbox(loop), Inbox(entry.loop)
        with self.lock:
            self._channels[mine.key] = mine
            self._channels[theirs.key] = theirs
        _call(entry.loop, functools.partial(entry.on_channel, theirs))
        _call(loop, functools.partial(self._connected, mine, future))

    def _other_end(self, channel: Channel) -> Optional[Channel]:
        return self._channels.get((self.rank, channel.cid, not channel.initiator))

    def _send_here(self, channel: Channel, views: Frames, future: asyncio.Future[int]) -> None:
        """Hand the other end a copy of the frames (on the writer's loop; done at once, like a socket's write)."""
        copies = wire.copied(views)  # before the lock: MPI's users need not wait for a copy
        with self.lock:
            if self.progress.error is not None:
                raise self.progress.failure(self.progress.error)
            if channel.local_closed or channel.peer_closed:
                from distributed.comm.core import CommClosedError

                future.set_exception(CommClosedError(f"mpi:// connection to rank {channel.peer} is closed"))
                return
            other = self._other_end(channel)
            if other is not None and other.inbox is not None and not other.local_closed:
                other.inbox.deliver(copies)
        future.set_result(sum(view.nbytes for view in views))

    def _close_here(self, channel: Channel) -> None:
        """Tell the other end (its reader gets EOF), which answers as over MPI; both are gone once both closed."""
        if channel.peer_closed:
            self._channels.pop(channel.key, None)
        other = self._other_end(channel)
        if other is None or other.peer_closed:
            return
        other.peer_closed = True
        if not other.local_closed:
            self._close(other)
        self._channels.pop(other.key, None)
        if other.inbox is not None:
            other.inbox.deliver(EOF)

    def _poll(self) -> bool:
        """Receive every message that has arrived; deliver completed ones in each connection's order."""
        with self.lock:
            return self._poll_locked()

    def _poll_locked(self) -> bool:
        busy = False
        misses = 0
        while True:
            message = self.comm.Improbe(self.MPI.ANY_SOURCE, self.tag, self._status)
            if message is None:
                misses += 1
                if misses == 2 or not self._owed():  # a ring announced more: probe once again, for MPI shows a
                    break  # message that has just arrived at the probe after the one that progressed
                continue
            busy = True
            source = self._status.Get_source()
            self._received[source] = self._received.get(source, 0) + 1
            buffer = np.empty(self._status.Get_count(self.MPI.BYTE), dtype=np.uint8)
            request = message.Irecv([buffer, self.MPI.BYTE])
            if not request.Test():  # the sender must move the rest (see `_watch_sent`): ask it to, then wait
                self._ask_push(source)
                self._finish_receive(request, source, buffer)
            self._handle(source, buffer)
        return self._complete() or busy

    def _finish_receive(self, request: Any, source: int, buffer: np.ndarray) -> None:
        """Wait for the rest of a message whose start has arrived, testing every 10 us (naps, not a spin: the
        sender may need this core) and after RECEIVE_HOT with growing naps, for at most RECEIVE_SECONDS: a sender
        that stops moving it (hung, or dead without MPI noticing) fails this transport with an error that names
        it, instead of a hang. The tests move the message too (over a network, MPI reads the socket in them):
        naps growing from the start to 1 ms made a 1 MiB message across a 1 Gbit/s link take twice tcp://'s
        time."""
        start = time.monotonic()
        nap, deadline = 10e-6, start + RECEIVE_SECONDS
        while not request.Test():
            now = time.monotonic()
            if now > deadline:
                self._abandoned.append((request, buffer))  # MPI may still write into it: keep it alive
                raise MPITransportError(
                    f"mpi://: a {buffer.nbytes}-byte message from rank {source} has not finished arriving after "
                    f"{RECEIVE_SECONDS:g} s (its first bytes came): that rank has stopped moving it (hung, or dead); "
                    "this process's mpi:// connections cannot go on"
                )
            time.sleep(nap)
            if now - start > RECEIVE_HOT:
                nap = min(2 * nap, 1e-3)

    def _complete(self) -> bool:
        """Deliver every message whose frames have all arrived, in each connection's order."""
        busy = False
        for channel in list(self._arriving):
            busy = self._deliver(channel) or busy
            if not channel.receiving:
                self._arriving.discard(channel)
            else:
                self._push_if_stuck(channel.peer, channel.receiving[0])
        return busy

    def _push_if_stuck(self, source: int, arrival: Arrival) -> None:
        """A large message still arriving after PUSH_AFTER: its sender must move it (no single-copy path)."""
        if not arrival.asked and time.monotonic() - arrival.since > PUSH_AFTER:
            arrival.asked = True
            self._ask_push(source)

    def _receive(self, channel: Channel, requests: list[Any], views: Optional[Frames]) -> None:
        channel.receiving.append(Arrival(requests, views, time.monotonic()))
        self._arriving.add(channel)

    def _handle(self, source: int, buffer: np.ndarray) -> None:
        kind, cid, side, payload, inline = wire.unpack(buffer)
        K = wire.Kind
        if kind == K.CONNECT:
            self._learn_doorbell(source, payload[1:])
            self._accept(source, cid, str(payload[0]))
            return
        if kind in (K.ACCEPT, K.REFUSE):
            loop, future = self._connecting.pop(cid, (None, None))
            if loop is None or future is None:
                return
            if kind == K.ACCEPT:
                self._learn_doorbell(source, payload)
            if kind == K.REFUSE:
                error = ConnectionRefusedError(f"no mpi:// listener at mpi://{source}:{payload[0]}")
                _resolve(loop, future, error=error)
                return
            channel = Channel(source, cid, True)
            self._channels[channel.key] = channel
            channel.inbox = Inbox(loop)
            _call(loop, functools.partial(self._connected, channel, future))
            return
        found = self._channels.get((source, cid, side == 0))
        if kind == K.CLOSE:
            if found is not None:
                self._receive(found, [], None)  # EOF, after any data still in flight
            return
        if kind == K.INLINE:
            if found is not None and not found.local_closed:
                self._receive(found, [], inline)
            return
        # DATA: always receive its frames now (they are the next messages of this stream), then keep or drop them
        views = wire.receive_buffers(payload)
        requests = [
            self.comm.Irecv([v[a:b], self.MPI.BYTE], source=source, tag=self.tag)
            for v in views
            for a, b in wire.chunks(v.nbytes, self.chunk)
        ]
        if found is not None and not found.local_closed:
            self._receive(found, requests, views)
        elif requests:  # a closed connection: receive and drop
            self.progress.watch(requests, functools.partial(self._fetched, source), keep=views)

    def _accept(self, source: int, cid: int, ident: str) -> None:
        entry = self._listeners.get(ident)
        if entry is None:
            self._control(source, wire.pack_header(wire.Kind.REFUSE, cid, 0, int(ident)))
            return
        channel = Channel(source, cid, False)
        channel.inbox = Inbox(entry.loop)
        self._channels[channel.key] = channel
        self._control(source, wire.pack_header(wire.Kind.ACCEPT, cid, 0, *self.doorbell.address.words()))
        _call(entry.loop, functools.partial(entry.on_channel, channel))

    def _learn_doorbell(self, rank: int, words: list[int]) -> None:
        if len(words) >= 3 and rank != self.rank:
            self._bells[rank] = BellAddress(*words[:3])

    def _deliver(self, channel: Channel) -> bool:
        busy = False
        while channel.receiving:
            arrival = channel.receiving[0]
            requests, views = arrival.requests, arrival.views
            if requests and not self.MPI.Request.Testall(requests):
                break
            channel.receiving.pop(0)
            busy = True
            if requests:
                self._fetched(channel.peer)
            inbox = channel.inbox
            assert inbox is not None
            if views is None:  # the peer's CLOSE
                channel.peer_closed = True
                if not channel.local_closed:
                    self._close(channel)
                self._channels.pop(channel.key, None)
                inbox.deliver(EOF)
                break
            if not channel.local_closed:
                inbox.deliver(views)
        return busy

    def _on_failure(self, failure: BaseException) -> None:
        """The progress thread is dying: fail the connects waiting for an answer and every connection's reader."""
        connecting, self._connecting = self._connecting, {}
        for loop, future in connecting.values():
            _reject(loop, future, failure)
        for channel in list(self._channels.values()):
            inbox = channel.inbox
            if inbox is not None:
                _call(inbox.loop, functools.partial(inbox.fail, failure))

    def stop(self) -> None:
        """Stop the progress thread; if it is stuck inside MPI (a collective that never completes), abort the job:
        finalising MPI under a thread that is still in a call would crash instead of reporting."""
        self.progress.stop(timeout=10.0)
        loop = self._bell_loop
        if loop is not None and not loop.is_closed():
            _call(loop, self._detach_doorbell)
        else:
            self.doorbell.close()
        if self.progress.thread.is_alive():
            frame = sys._current_frames().get(self.progress.thread.ident or -1)
            where = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"
            print(
                f"hpdl.dask: rank {self.rank}: the mpi:// progress thread is still inside an MPI call at exit; "
                f"aborting the MPI job. It is at:\n{where}",
                file=sys.stderr,
                flush=True,
            )
            self.comm.Abort(1)

    def _detach_doorbell(self) -> None:
        loop = asyncio.get_running_loop()
        for fd in self.doorbell.filenos():
            loop.remove_reader(fd)
        self.doorbell.close()


def _nothing() -> None:
    pass


def _raise(error: BaseException) -> None:
    raise error


def _guarded(loop: asyncio.AbstractEventLoop, future: asyncio.Future, fn: Callable[..., Any], *args: Any) -> None:
    """Run an operation on the progress thread; an error (an MPI error, say) fails its future, not the thread."""
    try:
        fn(*args)
    except Exception as error:  # noqa: BLE001 - handed to the awaiting coroutine
        _resolve(loop, future, error=error)


def _reject(loop: asyncio.AbstractEventLoop, future: asyncio.Future, error: BaseException) -> None:
    _resolve(loop, future, error=error)


def _call(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> None:
    """Run `fn` on `loop` soon, in order with everything else handed to it (no self-pipe write from its own thread)."""
    try:
        if asyncio._get_running_loop() is loop:
            loop.call_soon(fn)
        else:
            loop.call_soon_threadsafe(fn)
    except RuntimeError:  # the loop has closed: nobody waits any more
        pass


def _resolve(
    loop: asyncio.AbstractEventLoop,
    future: asyncio.Future,
    result: Any = None,
    error: Optional[BaseException] = None,
) -> None:
    def done() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    _call(loop, done)


_hub: Optional[Hub] = None
_hub_lock = threading.Lock()


def get_hub() -> Hub:
    """This process's hub, started on first use (MPI initialised by mpi4py if it is not yet)."""
    global _hub
    with _hub_lock:
        if _hub is not None and _hub.progress.error is not None:
            raise MPITransportError(f"the mpi:// progress thread failed: {_hub.progress.error!r}")
        if _hub is None:
            _hub = Hub()
            atexit.register(_hub.stop)
        elif not _hub.progress.running:
            raise TransportStopped("the mpi:// transport has been stopped in this process (it is shutting down)")
        return _hub
