"""A cluster of N hosts on this machine: network and UTS namespaces on a bridge, each host's link shaped.

`hpdl cluster up --hosts 2 --link 1gbit` makes, for a cluster named NAME (default "hpdl"):
- a switch: the network namespace `NAME-sw` with a bridge;
- per host H (a, b, ...): the network namespace `NAME-H`, whose `eth0` (one end of a veth pair, the other end on
  the bridge) has the address 10.231.K.(i+1)/24 and no route anywhere else. Its `/etc/hosts` (`ip netns exec`
  mounts `/etc/netns/NAME-H/hosts` over it) names every host of the cluster;
- a token bucket (tbf) on each end of each link when `--link RATE` is given: each host sends and receives at that
  rate (netem, which would add delay, is not in this kernel).
Nothing is added to the root namespace: the addresses exist only inside the hosts' namespaces.

`hpdl cluster exec H -- command` runs a command on host H: in its network namespace, in a UTS namespace whose
host name is H, with this working folder and environment. It is the remote shell: MPICH's Hydra runs it as
`-launcher ssh -launcher-exec "hpdl cluster exec"` (it calls `EXEC -x HOST command`), Open MPI as
`plm_rsh_agent`. Every host shares this machine's file system and /dev/shm, as the nodes of a cluster share a
file system; MPI keeps one node's segments apart from another's by their names.

`hpdl cluster down` removes it all, whatever state it is in (after a crash too). It needs root (CAP_NET_ADMIN
and CAP_SYS_ADMIN); `available()` says why not where it cannot run.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import string
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

__all__ = ["Cluster", "available", "down", "exec_argv", "load", "remote_shell", "set_link", "shape", "up"]

STATE_DIR = "/run/hpdl-cluster"
SUBNET = "10.231"
"""10.231.K.0/24 for the cluster numbered K (0 for the default name): inside the namespaces only."""
MTU = 1500


@dataclass
class Cluster:
    name: str
    hosts: list[str]
    """Host names: a, b, c, ... (also their UTS host names)."""
    addresses: dict[str, str]
    link: Optional[str]
    """The tbf rate of each host's link ("1gbit"), or None: unshaped."""

    def namespace(self, host: str) -> str:
        return f"{self.name}-{host}"

    @property
    def switch(self) -> str:
        return f"{self.name}-sw"


def remote_shell() -> str:
    """The path of `hpdl-cluster-rsh` beside this Python: a launcher runs it by path, and the environment's bin
    folder need not be on PATH (in CI it is not)."""
    beside = os.path.join(os.path.dirname(sys.executable), "hpdl-cluster-rsh")
    return beside if os.access(beside, os.X_OK) else "hpdl-cluster-rsh"


def available() -> Optional[str]:
    """None when this process can make namespaces, else why not (the tests that need them say it)."""
    if os.name != "posix" or not os.path.exists("/proc/self/ns/net"):
        return "network namespaces are a Linux feature"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); run as root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    probe = f"hpdl-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*argv: str, namespace: Optional[str] = None) -> None:
    command = ["ip", "netns", "exec", namespace, *argv] if namespace else list(argv)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip() or done.stdout.strip()}")


def _state_path(name: str) -> str:
    return os.path.join(STATE_DIR, f"{name}.json")


def _subnet(name: str) -> str:
    number = 0 if name == "hpdl" else 1 + sum(map(ord, name)) % 200
    return f"{SUBNET}.{number}"


def up(hosts: int = 2, link: Optional[str] = None, name: str = "hpdl") -> Cluster:
    """Make the cluster (after removing any left from before under the same name)."""
    if not 1 <= hosts <= 26:
        raise ValueError(f"--hosts {hosts}: between 1 and 26 hosts")
    why = available()
    if why:
        raise RuntimeError(f"cannot make a simulated cluster here: {why}")
    down(name)
    names = list(string.ascii_lowercase[:hosts])
    subnet = _subnet(name)
    cluster = Cluster(name, names, {h: f"{subnet}.{i + 1}" for i, h in enumerate(names)}, link)
    try:
        _run("ip", "netns", "add", cluster.switch)
        _run("ip", "link", "add", "br0", "type", "bridge", namespace=cluster.switch)
        _run("ip", "link", "set", "br0", "up", namespace=cluster.switch)
        hosts_file = "".join(f"{address}\t{host}\n" for host, address in cluster.addresses.items())
        for host in names:
            ns = cluster.namespace(host)
            _run("ip", "netns", "add", ns)
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as out:
                out.write(f"127.0.0.1\tlocalhost\n{hosts_file}")
            # the pair is made in the switch's namespace, then one end moves to the host: no name in the root's
            _run(
                "ip",
                "link",
                "add",
                f"{host}-port",
                "type",
                "veth",
                "peer",
                "name",
                f"{host}-eth",
                namespace=cluster.switch,
            )
            _run("ip", "link", "set", f"{host}-eth", "netns", ns, namespace=cluster.switch)
            _run("ip", "link", "set", f"{host}-port", "master", "br0", "up", namespace=cluster.switch)
            _run("ip", "link", "set", f"{host}-eth", "name", "eth0", namespace=ns)
            _run("ip", "addr", "add", f"{cluster.addresses[host]}/24", "dev", "eth0", namespace=ns)
            _run("ip", "link", "set", "eth0", "mtu", str(MTU), "up", namespace=ns)
            _run("ip", "link", "set", "lo", "up", namespace=ns)
            if link:
                shape(cluster, host, link)
        os.makedirs(STATE_DIR, exist_ok=True)
        with open(_state_path(name), "w") as out:
            json.dump(asdict(cluster), out)
    except Exception:
        down(name)
        raise
    return cluster


def shape(cluster: Cluster, host: str, rate: str) -> None:
    """Each direction of `host`'s link at `rate` (tbf: the host's eth0 sends, its switch port delivers)."""
    for device, namespace in (("eth0", cluster.namespace(host)), (f"{host}-port", cluster.switch)):
        _run(
            "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms",
            namespace=namespace,
        )  # fmt: skip


def set_link(cluster: Cluster, host: str, state: str) -> None:
    """Take `host`'s link down ("down") or bring it back ("up"), from the switch's side: a cable pulled."""
    _run("ip", "link", "set", f"{host}-port", state, namespace=cluster.switch)


def load(name: str = "hpdl") -> Optional[Cluster]:
    """The cluster `up` made under `name`, or None."""
    try:
        with open(_state_path(name)) as source:
            return Cluster(**json.load(source))
    except (OSError, ValueError, TypeError):
        return None


def down(name: str = "hpdl") -> None:
    """Remove every namespace and file of the cluster `name`, whatever is left of it."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    ours = [line.split()[0] for line in listed if line.split() and line.split()[0].startswith(f"{name}-")]
    for namespace in ours:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        shutil.rmtree(f"/etc/netns/{namespace}", ignore_errors=True)
    try:
        os.unlink(_state_path(name))
    except OSError:
        pass


def caller_host(cluster: Cluster) -> Optional[str]:
    """The host of `cluster` whose network namespace this process is in, or None (the machine's own, another)."""
    try:
        mine = os.stat("/proc/self/ns/net").st_ino
        for host in cluster.hosts:
            if os.stat(f"/var/run/netns/{cluster.namespace(host)}").st_ino == mine:
                return host
    except OSError:
        pass
    return None


def unreachable(cluster: Cluster, host: str, seconds: float = 3.0) -> Optional[str]:
    """Why `host` cannot be reached from the host this process runs on, as ssh would find (None: it can).

    ssh needs the network: from inside another host of the cluster, a TCP connection to `host`'s port 22 is
    tried (refused means reachable: nothing listens there); a link that is down times out or finds no route.
    From outside the cluster's hosts nothing is sent (their addresses exist only inside them)."""
    caller = caller_host(cluster)
    if caller is None or caller == host:
        return None
    try:
        socket.create_connection((cluster.addresses[host], 22), timeout=seconds).close()
    except ConnectionRefusedError:
        return None
    except OSError as error:
        return f"connect to host {host} port 22: {error.strerror or 'Connection timed out'}"
    return None


def exec_argv(cluster: Cluster, host: str, command: Sequence[str]) -> list[str]:
    """The command line that runs `command` on `host` as ssh would: its words joined and read by a shell there, in
    the host's network namespace, under its host name, in this folder (a cluster's shared file system)."""
    if host not in cluster.addresses:
        raise ValueError(f"no host {host!r} in the cluster {cluster.name!r} (hosts: {', '.join(cluster.hosts)})")
    inner = 'hostname "$0" && cd "$1" && exec sh -c "$2"'
    return [
        "ip", "netns", "exec", cluster.namespace(host), "unshare", "--uts", "sh", "-c", inner, host, os.getcwd(),
        " ".join(command),
    ]  # fmt: skip
