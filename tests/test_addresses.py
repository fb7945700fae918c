"""Which address of rank 0's host the other hosts reach (hpdl.runtime.addresses), from made-up interface tables,
and the agreement over a made-up MPI (the real one across hosts: test_multihost_rendezvous.py)."""

from __future__ import annotations

import socket
import threading
from typing import Any, Optional

import pytest

from hpdl.errors import BackendUnavailableError
from hpdl.runtime import addresses
from hpdl.runtime.addresses import LOOPBACK, Address, HostView, agree_address, candidates


def host(name: str, *entries: str) -> HostView:
    """host("a", "eth0 10.0.0.1/24", ...)"""
    table = []
    for entry in entries:
        interface, cidr = entry.split()
        address, prefix = cidr.split("/")
        table.append(Address(interface, address, int(prefix)))
    return HostView(name, tuple(table))


def no_route(address: str) -> Optional[str]:
    return None


DOCKER = "docker0 172.17.0.1/16"


def test_one_host_takes_loopback() -> None:
    a = host("a", "eth0 10.0.0.1/24")
    assert candidates([a, a, a], no_route) == [LOOPBACK]


def test_subnet_every_host_shares() -> None:
    views = [host("a", "eth0 10.0.0.1/24"), host("a", "eth0 10.0.0.1/24"), host("b", "eth0 10.0.0.2/24")]
    assert candidates(views, no_route) == ["10.0.0.1"]


def test_a_bridge_with_one_address_on_every_host_joins_no_one() -> None:
    """docker0 172.17.0.1 on every host, listed first: never chosen, though every host has that subnet."""
    views = [
        host("a", DOCKER, "eth0 192.168.1.10/24", "ib0 10.10.0.1/16"),
        host("b", DOCKER, "eth0 192.168.1.11/24", "ib0 10.10.0.2/16"),
        host("c", DOCKER, "eth0 192.168.1.12/24", "ib0 10.10.0.3/16"),
    ]
    assert candidates(views, no_route) == ["192.168.1.10", "10.10.0.1"]
    only_docker = [host("a", DOCKER), host("b", DOCKER)]
    assert candidates(only_docker, no_route) == []


def test_peers_that_share_one_address_are_not_joined() -> None:
    """b and c both 192.168.122.5 (each its own NAT'd network) with a at .1: no network joins all three."""
    views = [
        host("a", "virbr0 192.168.122.1/24", "eth0 10.0.0.1/24"),
        host("b", "virbr0 192.168.122.5/24", "eth0 10.0.0.2/24"),
        host("c", "virbr0 192.168.122.5/24", "eth0 10.0.0.3/24"),
    ]
    assert candidates(views, no_route) == ["10.0.0.1"]


def test_a_subnet_some_hosts_lack_is_not_shared() -> None:
    views = [
        host("a", "eth0 10.0.0.1/24", "eth1 10.1.0.1/24"),
        host("b", "eth0 10.0.0.2/24"),
        host("c", "eth0 10.0.0.3/24", "eth1 10.1.0.3/24"),
    ]
    assert candidates(views, no_route) == ["10.0.0.1"]


def test_hosts_on_different_subnets_take_the_route_source() -> None:
    """a on 10.0.1.0/24, b and c on other subnets behind routers: the source of a's routes toward them."""
    views = [
        host("a", DOCKER, "eth0 10.0.1.5/24"),
        host("b", DOCKER, "eth0 10.0.2.7/24"),
        host("c", DOCKER, "eth0 10.0.3.9/24"),
    ]
    routes = {"10.0.2.7": "10.0.1.5", "10.0.3.9": "10.0.1.5"}
    asked: list[str] = []

    def route(address: str) -> Optional[str]:
        asked.append(address)
        return routes.get(address)

    assert candidates(views, route) == ["10.0.1.5"]
    assert sorted(asked) == ["10.0.2.7", "10.0.3.9"]  # never toward a docker0 address (a's own bridge)


def test_shared_subnets_first_then_route_sources() -> None:
    """Some hosts share rank 0's subnet, others are behind a router: the route source toward those (rank 0's
    address on the shared subnet, its default route's) reaches both kinds; a subnet all share comes first."""
    views = [
        host("a", "eth0 10.0.0.1/24", "eth1 10.9.0.1/24"),
        host("b", "eth0 10.0.0.2/24"),
        host("c", "eth0 10.5.0.3/24"),
    ]
    assert candidates(views, {"10.5.0.3": "10.0.0.1"}.get) == ["10.0.0.1"]
    assert candidates(views, {"10.5.0.3": "10.9.0.1"}.get) == ["10.9.0.1"]
    two = [host("a", "eth0 10.0.0.1/24", "eth1 10.9.0.1/24"), host("b", "eth0 10.0.0.2/24", "eth5 10.5.0.3/24")]
    assert candidates(two, {"10.5.0.3": "10.9.0.1"}.get) == ["10.0.0.1", "10.9.0.1"]


def test_link_local_last_and_point_to_point_never() -> None:
    views = [
        host("a", "eth9 169.254.3.1/16", "tun0 10.8.0.1/32", "eth0 10.0.0.1/24"),
        host("b", "eth9 169.254.3.2/16", "tun0 10.8.0.2/32", "eth0 10.0.0.2/24"),
    ]
    assert candidates(views, no_route) == ["10.0.0.1", "169.254.3.1"]


class FakeMpi:
    """Collectives among threads, one per rank, each rank's own view of its host."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list[Any] = [None] * size
        self.mine = threading.local()
        """.rank: the calling thread's rank"""

    def allgather(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        gathered = list(self.slots)
        self.barrier.wait()
        return gathered

    def broadcast(self, rank: int, value: Any) -> Any:
        return self.allgather(rank, value)[0]

    def run(self, views: list[HostView], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
        mine = self.mine
        monkeypatch.setattr(addresses, "host_view", lambda: views[mine.rank])
        results: list[Any] = [None] * self.size

        def rank_main(rank: int) -> None:
            mine.rank = rank
            try:
                results[rank] = agree_address(
                    lambda value: self.broadcast(rank, value), lambda value: self.allgather(rank, value), rank, "test"
                )
            except BackendUnavailableError as error:
                results[rank] = error

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        return results


def test_agreement_tries_candidates_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first candidate (not an address of this machine: rank 0 cannot listen) is skipped, the second (this
    machine's loopback, standing in for a shared network) reached by every rank, who all return it."""
    monkeypatch.delenv("HPDL_BIND_ADDR", raising=False)
    monkeypatch.setattr(addresses, "candidates", lambda views: ["192.0.2.123", "127.0.0.1"])
    views = [host("a"), host("b"), host("b")]
    assert FakeMpi(3).run(views, monkeypatch) == ["127.0.0.1"] * 3


def test_agreement_fails_on_every_rank_naming_what_was_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPDL_BIND_ADDR", raising=False)
    views = [host("a", DOCKER, "eth0 10.0.1.5/24"), host("b", DOCKER, "eth0 10.0.2.7/24")]
    monkeypatch.setattr(addresses, "route_source", no_route)
    results = FakeMpi(2).run(views, monkeypatch)
    assert all(isinstance(r, BackendUnavailableError) for r in results), results
    text = str(results[1])
    assert "172.17.0.1/16 (docker0), 10.0.1.5/24 (eth0)" in text and "10.0.2.7/24 (eth0)" in text
    assert "Set HPDL_BIND_ADDR" in text

    monkeypatch.setattr(addresses, "candidates", lambda views: ["192.0.2.123"])  # not this machine's
    results = FakeMpi(2).run(views, monkeypatch)
    assert "tried 192.0.2.123 (rank 0 cannot listen there" in str(results[0]), results
    assert str(results[0]) == str(results[1])


def test_bind_addr_is_the_only_candidate_and_is_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    views = [host("a", "eth0 10.0.0.1/24"), host("b", "eth0 10.0.0.2/24")]
    monkeypatch.setenv("HPDL_BIND_ADDR", "127.0.0.1")
    assert FakeMpi(2).run(views, monkeypatch) == ["127.0.0.1"] * 2
    monkeypatch.setenv("HPDL_BIND_ADDR", "0.0.0.0")
    results = FakeMpi(2).run(views, monkeypatch)
    assert all("every interface" in str(r) for r in results), results


def test_unreached_candidate_names_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HPDL_BIND_ADDR", raising=False)
    monkeypatch.setattr(addresses, "candidates", lambda views: ["127.0.0.1"])
    fake = FakeMpi(4)
    monkeypatch.setattr(addresses, "_reaches", lambda address, port: fake.mine.rank == 2)
    results = fake.run([host("a"), host("b"), host("c"), host("d")], monkeypatch)
    assert all("tried 127.0.0.1 (ranks 1, 3 could not connect)" in str(r) for r in results), results


def test_this_machines_own_table() -> None:
    """The ioctl reading: no loopback address, each address on an interface this machine has."""
    names = {name for _, name in socket.if_nameindex()}
    table = addresses.local_addresses()
    assert all(not a.address.startswith("127.") and a.interface in names and 0 <= a.prefix <= 32 for a in table)
    if table:
        assert addresses.interface_of(table[0].address) == table[0].interface
    assert addresses.interface_of("127.0.0.1") in ("lo", "lo0")
