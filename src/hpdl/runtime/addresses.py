"""Which address of rank 0's host the other hosts of a job reach: where a listener of rank 0 (the torch
rendezvous store, a Dask scheduler) binds, and what the other ranks are told to connect to.

The ranks agree on it over MPI (which reaches every rank already): each tells its host's identity and its
IPv4 interface addresses with their netmasks, then rank 0 tries candidate addresses in turn (a listening
socket on the address, a connection to it from every other rank, each within seconds) and every rank takes
the first that all of them reached. The candidates, best first:

1. an address of rank 0 on a subnet on which every other host has an address of its own, different from
   rank 0's and from each other's: a network that joins them. A bridge that every host has with the same
   address on each (Docker's docker0, 172.17.0.1 everywhere; libvirt's virbr0) joins no one and is never one;
2. the source address of rank 0's route to another host's address (a UDP socket's `connect`, which sends
   nothing, then `getsockname`): hosts on different subnets, joined by routers.

It never comes from resolving a host name: many clusters cannot resolve their nodes' names, and on
Debian/Ubuntu a host's own name resolves to 127.0.1.1. HPDL_BIND_ADDR chooses the address instead (it is
the only candidate then, still tried); a job whose ranks share one network namespace takes 127.0.0.1.
Interfaces are read with ioctl (SIOCGIFADDR, SIOCGIFNETMASK: one IPv4 address per interface, its primary;
Linux only, elsewhere only HPDL_BIND_ADDR or a job on one host works).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from typing import Any, Callable, NamedTuple, Optional, Sequence

import hpdl.settings as settings
from hpdl.errors import BackendUnavailableError

__all__ = [
    "Address",
    "HostView",
    "LOOPBACK",
    "agree_address",
    "candidates",
    "host_view",
    "interface_of",
    "local_addresses",
]

LOOPBACK = "127.0.0.1"
PROBE_SECONDS = 5.0
"""How long a rank tries to connect to a candidate: an address that drops packets costs this, not a store timeout."""

_SIOCGIFFLAGS, _SIOCGIFADDR, _SIOCGIFNETMASK = 0x8913, 0x8915, 0x891B
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8


class Address(NamedTuple):
    interface: str
    address: str
    prefix: int
    """The netmask's length: 24 for 255.255.255.0."""

    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"{self.address}/{self.prefix}", strict=False)


class HostView(NamedTuple):
    """What a rank tells the others: which host (network namespace) it runs in, and that host's addresses."""

    host: str
    addresses: tuple[Address, ...]


def local_addresses() -> list[Address]:
    """This host's IPv4 addresses on interfaces that are up, loopback left out (empty where ioctl cannot say)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return []
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in names:
            try:
                request = struct.pack("256s", name.encode()[:15])
                flags = struct.unpack("H", _ioctl(probe, _SIOCGIFFLAGS, request)[16:18])[0]
                if not flags & _IFF_UP or flags & _IFF_LOOPBACK:
                    continue
                address = socket.inet_ntoa(_ioctl(probe, _SIOCGIFADDR, request)[20:24])
                mask = socket.inet_ntoa(_ioctl(probe, _SIOCGIFNETMASK, request)[20:24])
            except OSError:  # no IPv4 address on it, or no such ioctl (not Linux)
                continue
            if not address.startswith("127."):
                found.append(Address(name, address, ipaddress.IPv4Network(f"0.0.0.0/{mask}").prefixlen))
    return found


def _ioctl(sock: socket.socket, request: int, argument: bytes) -> bytes:
    import fcntl

    return fcntl.ioctl(sock.fileno(), request, argument)


def host_view() -> HostView:
    """This rank's host, as the network sees it: the kernel's boot id and the network namespace (ranks that share
    both share a loopback interface; hosts of one machine in network namespaces do not), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as source:
            host = f"{source.read().strip()}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        host = socket.gethostname()
    return HostView(host, tuple(local_addresses()))


def route_source(address: str) -> Optional[str]:
    """This host's source address on the route to `address` (None: no route). A UDP `connect` sends nothing."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def interface_of(address: str) -> Optional[str]:
    """The interface of this host whose route reaches `address` (its own, for one of this host's addresses)."""
    if address.startswith("127."):
        return next((name for _, name in socket.if_nameindex() if name in ("lo", "lo0")), "lo")
    source = route_source(address)
    return next((a.interface for a in local_addresses() if a.address == source), None)


def candidates(views: Sequence[HostView], route: Callable[[str], Optional[str]] = route_source) -> list[str]:
    """Rank 0's addresses (views[0] is its view) that may reach every other host, best first (see the module's
    docstring); [LOOPBACK] when every rank runs in rank 0's network namespace. `route`: rank 0's source
    address toward an address (`route_source`; tests pass a table)."""
    home = views[0]
    peers = list({view.host: view.addresses for view in views if view.host != home.host}.values())
    if not peers:
        return [LOOPBACK]
    chosen = [a.address for a in home.addresses if _joins(a, peers)]
    chosen.sort(key=lambda address: ipaddress.IPv4Address(address).is_link_local)  # 169.254/16 last
    own = {a.address for a in home.addresses}
    attached = [a.network() for a in home.addresses]
    reached: dict[str, int] = {}  # route sources, by how many hosts' addresses they lead to
    for addresses in peers:
        sources = set()
        for peer in addresses:
            ip = ipaddress.IPv4Address(peer.address)
            # an address on a subnet of rank 0's own is in `chosen` already, or on a bridge of rank 0's too
            if peer.address in own or ip.is_link_local or any(ip in net for net in attached):
                continue
            source = route(peer.address)
            if source in own:
                sources.add(source)
        for source in sources:
            reached[source] = reached.get(source, 0) + 1
    chosen += sorted((s for s in reached if s not in chosen), key=lambda s: -reached[s])
    return chosen


def _joins(mine: Address, peers: Sequence[Sequence[Address]]) -> bool:
    """Whether every other host has an address on `mine`'s subnet, each different from rank 0's and the others'."""
    network, taken = mine.network(), {mine.address}
    for addresses in peers:
        free = [a.address for a in addresses if ipaddress.IPv4Address(a.address) in network and a.address not in taken]
        if not free:
            return False
        taken.add(free[0])
    return True


def agree_address(
    broadcast: Callable[[Any], Any], allgather: Callable[[Any], list[Any]], rank: int, caller: str
) -> str:
    """The address of rank 0 that every rank reaches (called by every rank of the job, collectively).

    broadcast: an MPI broadcast from rank 0 of one object; allgather: an allgather of one object per rank.
    Raises BackendUnavailableError on every rank, naming the addresses tried, when none works.
    """
    views = allgather(host_view())
    if rank != 0:
        while True:
            told = broadcast(None)
            if told[0] == "none":
                raise BackendUnavailableError(f"{caller}: {told[1]}")
            if told[0] == "use":
                return str(told[1])
            if all(allgather(_reaches(told[1], told[2]))):
                return str(told[1])
    bind = settings.text("HPDL_BIND_ADDR")
    if bind and (bind.startswith("0.") or bind == "::"):
        why = f"HPDL_BIND_ADDR={bind} is every interface, not an address the other ranks can connect to"
        broadcast(("none", why))
        raise BackendUnavailableError(f"{caller}: {why}")
    if not bind and all(view.host == views[0].host for view in views):  # one host: nothing to try
        broadcast(("use", LOOPBACK))
        return LOOPBACK
    tried = [bind] if bind else candidates(views)
    failures = []
    for address in tried:
        try:
            listener = socket.create_server((address, 0), family=socket.AF_INET, backlog=max(128, len(views)))
        except OSError as error:
            failures.append(f"{address} (rank 0 cannot listen there: {error.strerror or error})")
            continue
        with listener:
            broadcast(("probe", address, listener.getsockname()[1]))
            reached = allgather(True)
        if all(reached):
            return address
        missing = [str(r) for r, ok in enumerate(reached) if not ok]
        failures.append(f"{address} (rank{'s' * (len(missing) > 1)} {', '.join(missing)} could not connect)")
    why = _nothing_works(views, failures, bind)
    broadcast(("none", why))
    raise BackendUnavailableError(f"{caller}: {why}")


def _reaches(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=PROBE_SECONDS).close()
        return True
    except OSError:
        return False


def _nothing_works(views: Sequence[HostView], failures: list[str], bind: Optional[str]) -> str:
    def listed(view: HostView) -> str:
        return ", ".join(f"{a.address}/{a.prefix} ({a.interface})" for a in view.addresses) or "none found"

    others = {view.host: view for view in views[1:] if view.host != views[0].host}
    if failures:
        said = f"no address of rank 0 reached every rank: tried {'; '.join(failures)}"
    else:
        said = "rank 0's host has no address on a subnet that every host shares, nor a route to the others"
    return (
        f"{said}. Rank 0's host has {listed(views[0])}; "
        + "; ".join(f"another host has {listed(view)}" for view in others.values())
        + (
            ". Set HPDL_BIND_ADDR (on every rank) to an address of rank 0's host that every host reaches"
            if not bind
            else f". HPDL_BIND_ADDR={bind} is not one every rank reaches: set it to an address of rank 0's host "
            "that every host reaches"
        )
    )
