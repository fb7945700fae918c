"""Rank 0's torch rendezvous store: where it listens (one address, never every interface) and who serves it.

torch's own TCPStore server listens on all interfaces; hpdl's listens on the
address the ranks share (127.0.0.1 for a job on one machine; across machines,
under MPI, the address of rank 0 that every rank reaches: see
`hpdl.runtime.addresses`), on a socket
bound before its port is told to anyone (no window in which another process
could take the port).
"""

from __future__ import annotations

import atexit
import os
import socket
from typing import Any, Callable

import hpdl.settings as settings
from hpdl.errors import BackendUnavailableError
from hpdl.runtime.addresses import agree_address, interface_of
from hpdl.runtime.environment import STORE_FD, torch_release

__all__ = ["listen_for_store", "open_store_over_mpi", "rendezvous_store", "serve_handed_store"]


def listen_for_store(host: str, size: int) -> int:
    """Rank 0: listen for the store on `host` (or HPDL_BIND_ADDR) at a port the system picks; return the port.

    Listening before the port is told to anyone leaves no gap in which another process could take it.
    """
    listener = _store_socket(host, 0, size)
    port = int(listener.getsockname()[1])
    os.environ[STORE_FD] = str(listener.detach())  # rendezvous_store serves on it
    return port


def _store_socket(host: str, port: int, size: int) -> socket.socket:
    """A socket listening on the address `host` names (HPDL_BIND_ADDR when set) at `port` (0: the system picks),
    with room for every rank's connection at once."""
    bind = settings.text("HPDL_BIND_ADDR") or socket.gethostbyname(host)
    try:
        return socket.create_server((bind, port), family=socket.AF_INET, backlog=max(128, size))
    except OSError as error:
        raise BackendUnavailableError(
            f"the torch rendezvous cannot listen on {bind}:{port} ({error}); set HPDL_BIND_ADDR to an address "
            "of this machine that the other ranks reach, or MASTER_PORT to a free port"
        ) from None


_handed_store: Any = None
"""Rank 0 of a torch job started by hpdl launch: the store's server, on the socket the launcher bound."""


def serve_handed_store() -> None:
    """Rank 0 of `hpdl launch --backend torch`: serve the rendezvous store on the socket the launcher bound.

    A script that calls torch's own `init_process_group` (env://) instead of hpdl's would bind MASTER_PORT
    again and fail with EADDRINUSE, the launcher's socket holding it. As under torchrun, whose agent hosts
    the store, every rank's env:// rendezvous connects to this server instead (TORCHELASTIC_USE_AGENT_STORE,
    which the launcher sets on every rank), and so does hpdl's own (`rendezvous_store`). The server lives as
    long as rank 0's process.
    """
    global _handed_store
    handed = os.environ.pop(STORE_FD, "")  # taken: a second call finds none
    if not handed:
        return
    import datetime

    from hpdl.comm.base import default_timeout

    env = os.environ
    span = datetime.timedelta(seconds=default_timeout())
    _handed_store = _server(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), span, int(handed))
    # At exit, after hpdl's own exit handlers (registered later, run first): a store server destroyed during
    # interpreter shutdown, once torch's own objects are gone, can abort the process.
    atexit.register(_release_handed_store)


def _release_handed_store() -> None:
    global _handed_store
    _handed_store = None


def rendezvous_store(rank: int, size: int, addr: str, port: int, span: Any) -> Any:
    """The torch rendezvous store; rank 0's server listens on one address, not on every interface.

    That address is HPDL_BIND_ADDR when set, else the one `addr` (MASTER_ADDR) names: 127.0.0.1 for a
    job on one machine, the interface the hosts share for a job across machines. torch's own
    TCPStore server would listen on all interfaces.
    """
    import torch.distributed as dist

    if rank != 0 or _handed_store is not None or _agent_serves_store():
        return dist.TCPStore(addr, port, size, is_master=False, timeout=span)
    handed = os.environ.pop(STORE_FD, "")  # bound already, by hpdl launch (spawn.store_listener) or listen_for_store
    # else MASTER_PORT of a launcher that serves no store: listen on it now; the store's server owns the socket
    fd = int(handed) if handed else _store_socket(addr, port, size).detach()
    return _server(addr, port, size, span, fd)


def _agent_serves_store() -> bool:
    """Whether torchrun's agent serves the store on MASTER_PORT (it says so with TORCHELASTIC_USE_AGENT_STORE, as
    torch's own env:// rendezvous reads it): then rank 0 is a client like the others, and a server of its own on
    that port fails with EADDRINUSE. `hpdl launch --backend torch` sets the same variable and hands rank 0 the
    socket instead (STORE_FD): that rank serves it."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and STORE_FD not in os.environ


def open_store_over_mpi(
    broadcast: Callable[[Any], Any], allgather: Callable[[Any], list[Any]], rank: int, size: int, span: Any, caller: str
) -> Any:
    """The rendezvous store of a job launched by MPI (every rank calls it): the ranks agree over MPI on the
    address of rank 0 that all of them reach (`hpdl.runtime.addresses`: 127.0.0.1 on one host, never a host
    name, HPDL_BIND_ADDR when set), rank 0 opens its server there, then tells its port (through `broadcast`,
    an MPI broadcast from rank 0; `allgather`, an MPI allgather of one object per rank) or why there is none,
    and the others connect. Each rank's gloo, unless GLOO_SOCKET_IFNAME says otherwise, takes the interface
    that reaches that address (gloo would take the one its host name resolves to: loopback, or none).

    The server first: told a port too early, the other ranks' clients would keep trying to connect, for the
    whole store timeout (30 minutes in torch's env://), to a server that never opened. They raise at once.
    """
    address = agree_address(broadcast, allgather, rank, caller)
    interface = interface_of(address)
    if interface:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    if rank == 0:
        try:
            port = listen_for_store(address, size)
            store = rendezvous_store(0, size, address, port, span)
        except Exception as exc:
            broadcast(f"{type(exc).__name__}: {exc}")
            raise
        broadcast(port)
        return store
    told = broadcast(None)
    if isinstance(told, str):
        raise BackendUnavailableError(f"{caller}: rank 0 could not open the rendezvous store ({told})")
    return rendezvous_store(rank, size, address, told, span)


def _server(addr: str, port: int, size: int, span: Any, fd: int) -> Any:
    """The store's server on the listening socket `fd` (it does not wait for the other ranks to connect).

    torch's libuv server takes a listening socket from torch 2.8 (pytorch#150215); before, it raises
    NotImplementedError (torch 2.4: every torch job of hpdl failed at its first step), and the older server,
    which takes one, serves instead."""
    import torch.distributed as dist

    def serve(libuv: bool) -> Any:
        return dist.TCPStore(
            addr, port, size, is_master=True, timeout=span, wait_for_workers=False, master_listen_fd=fd,
            use_libuv=libuv,
        )  # fmt: skip

    if torch_release() < (2, 8):
        return serve(False)
    try:
        return serve(True)
    except NotImplementedError:  # a build between releases without it: the socket is still unused
        return serve(False)
