"""The mpi:// backend of dask.distributed: `Comm`, `Connector`, `Listener` and `Backend`.

Registered through the `distributed.comm.backends` entry point (`mpi`), so
`Scheduler(protocol="mpi")`, `Worker(..., protocol="mpi")` and
`Client("mpi://0:1")` work in any process of an MPI job. Addresses are
`mpi://<rank>:<id>`: the rank in COMM_WORLD and a listener id on that rank
(listening on `mpi://` or `mpi://<my rank>:0` picks a free id). Messages are
serialised with distributed's `to_frames`/`from_frames` exactly as over TCP;
the frames travel over MPI point-to-point (see `hpdl.dask.connection`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from distributed.comm.core import BaseListener, Comm, CommClosedError, Connector
from distributed.comm.registry import Backend, backends
from distributed.comm.utils import from_frames, to_frames

from hpdl.dask import frames as wire
from hpdl.dask.connection import EOF, Channel, MPITransportError, TransportFailed, get_hub, parse_location

__all__ = ["MPIBackend", "MPIComm", "MPIConnector", "MPIListener", "MPITransportError", "register"]

logger = logging.getLogger(__name__)
PREFIX = "mpi://"


class MPIComm(Comm):
    """One established mpi:// connection; used from one event loop, like every Dask comm."""

    def __init__(self, channel: Channel, local_addr: str, peer_addr: str, deserialize: bool = True) -> None:
        super().__init__(deserialize=deserialize)
        self._channel = channel
        self._local_addr = local_addr
        self._peer_addr = peer_addr
        self._closed = False
        self._hub = get_hub()

    @property
    def local_address(self) -> str:
        return self._local_addr

    @property
    def peer_address(self) -> str:
        return self._peer_addr

    @property
    def same_host(self) -> bool:
        hub = self._hub
        return hub.host_of(self._channel.peer) == hub.hostname

    async def read(self, deserializers: Any = None) -> Any:
        if self._closed:
            raise CommClosedError(f"{self!r}: read on a closed comm")
        inbox = self._channel.inbox
        assert inbox is not None
        try:
            frames = await inbox.get()
        except CommClosedError:
            raise
        except TransportFailed as error:  # the transport died: to distributed, like a TCP connection reset
            self.abort()
            raise CommClosedError(f"{self!r}: {error}") from error
        except BaseException:
            self.abort()  # like TCP: a read interrupted half-way leaves the stream unusable
            raise
        if frames is EOF:
            self._closed = True
            raise CommClosedError(f"{self!r}: the peer closed the connection")
        try:
            return await from_frames(
                frames, deserialize=self.deserialize, deserializers=deserializers, allow_offload=self.allow_offload
            )
        except EOFError:
            self.abort()
            raise CommClosedError(f"{self!r}: aborted on truncated data") from None

    async def write(self, msg: Any, serializers: Any = None, on_error: Optional[str] = "message") -> int:
        if self.closed():
            raise CommClosedError(f"{self!r}: write on a closed comm")
        frames = await to_frames(
            msg,
            allow_offload=self.allow_offload,
            serializers=serializers,
            on_error=on_error,
            context={"sender": self.local_info, "recipient": self.remote_info, **self.handshake_options},
        )
        views = wire.send_views(frames)
        try:
            return await self._hub.send(self._channel, views, asyncio.get_running_loop())
        except CommClosedError:
            self._closed = True
            raise
        except TransportFailed as error:
            self._closed = True
            raise CommClosedError(f"{self!r}: {error}") from error

    async def close(self) -> None:
        self.abort()

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            self._hub.close(self._channel)
            inbox = self._channel.inbox
            if inbox is not None:
                inbox.interrupt(CommClosedError(f"{self!r}: closed"))

    def closed(self) -> bool:
        if self._closed:
            return True
        inbox = self._channel.inbox
        if inbox is not None and (inbox.at_eof() or (inbox.failed is not None and not inbox.messages)):
            self._closed = True  # the peer closed (or the transport died) and every earlier message has been read
        return self._closed


class MPIConnector(Connector):
    async def connect(self, address: str, deserialize: bool = True, **connection_args: Any) -> MPIComm:
        hub = get_hub()
        rank, ident = parse_location(address)
        hub.check_rank(rank, PREFIX + address)
        channel = await hub.connect(rank, ident)
        local = f"{PREFIX}{hub.rank}:c{channel.cid}"
        return MPIComm(channel, local, PREFIX + address, deserialize)


class MPIListener(BaseListener):
    prefix = PREFIX

    def __init__(self, loc: str, comm_handler: Any, deserialize: bool = True, **connection_args: Any) -> None:
        super().__init__()
        self.hub = get_hub()
        rank, ident = parse_location(loc) if loc else (self.hub.rank, "")
        if rank != self.hub.rank:
            raise ValueError(f"mpi://{loc}: a rank listens only on its own rank ({self.hub.rank}), not {rank}")
        self._ident = ident
        self.comm_handler = comm_handler
        self.deserialize = deserialize
        self._tasks: set[asyncio.Task[Any]] = set()
        self._started = False

    async def start(self) -> None:
        if self._started:
            return
        loop = asyncio.get_running_loop()
        self._ident = self.hub.listen(self._ident, loop, self._on_channel)
        self._started = True

    def _on_channel(self, channel: Channel) -> None:
        comm = MPIComm(channel, self.contact_address, f"{PREFIX}{channel.peer}:c{channel.cid}", self.deserialize)
        task = asyncio.ensure_future(self._handle(comm))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, comm: MPIComm) -> None:
        try:
            await self.on_connection(comm)
        except CommClosedError:
            logger.debug("mpi:// connection closed before the handshake completed")
            return
        await self.comm_handler(comm)

    def stop(self) -> None:
        if self._started:
            self._started = False
            self.hub.unlisten(self._ident)

    @property
    def listen_address(self) -> str:
        return self.contact_address

    @property
    def contact_address(self) -> str:
        return f"{PREFIX}{self.hub.rank}:{self._ident}"


class MPIBackend(Backend):
    """The `mpi` scheme: processes of one MPI job, addressed by rank and listener id."""

    def get_connector(self) -> MPIConnector:
        return MPIConnector()

    def get_listener(self, loc: str, handle_comm: Any, deserialize: bool, **connection_args: Any) -> MPIListener:
        return MPIListener(loc, handle_comm, deserialize)

    def get_address_host(self, loc: str) -> str:
        rank, _ = parse_location(loc)
        return get_hub().host_of(rank)

    def resolve_address(self, loc: str) -> str:
        parse_location(loc)
        return loc

    def get_local_address_for(self, loc: str) -> str:
        return f"{get_hub().rank}:0"


def register() -> None:
    """Make sure distributed knows the `mpi` scheme even where the entry point is shadowed (e.g. a stale
    egg-info on PYTHONPATH); the entry point alone serves processes that never import hpdl.dask."""
    if not isinstance(backends.get("mpi"), MPIBackend):
        backends["mpi"] = MPIBackend()


register()
