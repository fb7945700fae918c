"""A file descriptor for MPI: each process's doorbell, rung by a peer after it has sent it a message.

MPI offers nothing an event loop can wait on, so a receiver must either poll
(a core spinning, or up to a poll interval late: 750 us per small message
with the previous back-off poller) or be told. A sender rings the receiver's
doorbell (one datagram, `sendto` on a non-blocking socket, about 2 us) after
its MPI send; the receiver's event loop waits on the doorbell like on any
socket (`loop.add_reader`) and receives the MPI messages at once, in the
loop's own thread. The data travel over MPI; a ring carries the sender's
rank and how many messages it has sent to this process so far, so that the
receiver knows whether one is still on its way (MPI may show a message
after the ring that announces it: queued sends on shared memory, a network).

Two sockets: an abstract Unix datagram socket (peers in this network
namespace, no file on disk) and, where this host has an IPv4 address off
loopback, a UDP socket bound to it (peers on other hosts). A peer learns the
address at connection set-up (CONNECT and ACCEPT carry it, see
`hpdl.dask.connection`). A doorbell is a hint only: a lost or unroutable
datagram leaves the message to the progress thread's poll (at most
HPDL_DASK_POLL_MAX_US late), never undelivered.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import socket
import struct
from typing import NamedTuple, Optional

__all__ = ["FETCHED", "PUSH", "BellAddress", "Doorbell", "Rings"]

logger = logging.getLogger(__name__)
RING = struct.Struct("<qq")
"""A ring: the sender's rank and the count of messages it has sent to the receiver, or PUSH or FETCHED."""
PUSH = -1
"""The count of a ring that asks the receiver to drive MPI for its sends to the ringer: the ringer's receive cannot
finish without the sender's MPI calls (no single-copy path between them), which plain rings never need."""
FETCHED = -2
"""The count of a ring that tells the receiver the ringer has taken a large message it sent: the receiver does not
poll such sends (over shared memory the ringer copies them itself), and one MPI call of its now completes them."""


class Rings(NamedTuple):
    """What a doorbell's pending rings said."""

    counts: dict[int, int]
    """sender's rank -> the most messages it says it has sent to this process."""
    pushes: set[int]
    """Ranks that asked for a push (PUSH)."""


class BellAddress(NamedTuple):
    """Where a process's doorbell is: a 62-bit token (its Unix name) and an IPv4 address and port (0: none)."""

    token: int
    ipv4: int
    port: int

    def words(self) -> tuple[int, int, int]:
        return (self.token, self.ipv4, self.port)


def _unix_name(token: int) -> str:
    return f"\0hpdl-dask-bell-{token:016x}"


class Doorbell:
    """This process's doorbell (its sockets, `fileno` to wait on) and the ringing of peers' doorbells."""

    def __init__(self) -> None:
        self.token = secrets.randbits(62) | 1
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.unix.bind(_unix_name(self.token))
        self.unix.setblocking(False)
        self.udp: Optional[socket.socket] = None
        ipv4, port = 0, 0
        from hpdl.runtime.addresses import local_addresses

        for found in local_addresses()[:1]:  # the first address off loopback (a cluster host's own network)
            try:
                udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                udp.bind((found.address, 0))
                udp.setblocking(False)
            except OSError as error:
                logger.debug("mpi:// doorbell: no UDP socket on %s (%s): peers on other hosts are polled", found, error)
                continue
            self.udp = udp
            ipv4, port = int(ipaddress.IPv4Address(found.address)), udp.getsockname()[1]
        self.address = BellAddress(self.token, ipv4, port)
        self._names: dict[int, str] = {}
        """token -> its Unix name (made once per peer, not per ring)."""
        self._remote: set[int] = set()
        """Tokens of peers whose Unix name is not in this network namespace (another host): rung over UDP."""

    def filenos(self) -> list[int]:
        return [s.fileno() for s in (self.unix, self.udp) if s is not None]

    def ring(self, peer: BellAddress, rank: int, sent: int) -> None:
        """Ring a peer's doorbell (never blocks: a full queue already holds a ring, a lost one is polled for)."""
        ring = RING.pack(rank, sent)
        if peer.token not in self._remote:
            name = self._names.get(peer.token)
            if name is None:
                name = self._names[peer.token] = _unix_name(peer.token)
            try:
                self.unix.sendto(ring, name)
                return
            except BlockingIOError:
                return
            except OSError:  # no such name here: the peer is in another network namespace (host)
                self._remote.add(peer.token)
        if peer.port and self.udp is not None:
            try:
                self.udp.sendto(ring, (str(ipaddress.IPv4Address(peer.ipv4)), peer.port))
            except OSError:  # unreachable or full: the peer's poll finds the message
                pass

    def is_local(self, peer: BellAddress) -> bool:
        """Whether `peer` is in this network namespace (its Unix name answered the last ring: this host)."""
        return peer.token not in self._remote

    def drain(self, fd: Optional[int] = None) -> Rings:
        """Take every pending ring (of the socket `fd` only, if given: the one that is readable)."""
        counts: dict[int, int] = {}
        pushes: set[int] = set()
        for sock in (self.unix, self.udp):
            if sock is None or (fd is not None and sock.fileno() != fd):
                continue
            while True:
                try:
                    data = sock.recv(64)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:  # e.g. an ICMP error reported on the UDP socket
                    break
                if len(data) == RING.size:
                    rank, sent = RING.unpack(data)
                    if sent == PUSH:
                        pushes.add(rank)
                    elif sent == FETCHED:  # the wake-up is the message: the loop's receive tests every watched send
                        continue
                    else:
                        counts[rank] = max(sent, counts.get(rank, 0))
        return Rings(counts, pushes)

    def close(self) -> None:
        for sock in (self.unix, self.udp):
            if sock is not None:
                sock.close()
