"""`hpdl cluster up | down | exec | link | status`: a cluster of hosts on this machine (hpdl.runtime.sim_cluster).

hpdl cluster up --hosts 2 --link 1gbit      hosts a and b, each link shaped to 1 Gbit/s
hpdl cluster exec a hostname                a command on host a (as `ssh a hostname`)
hpdl cluster exec a hpdl launch -n 4 -H a:2,b:2 --launcher-exec hpdl-cluster-rsh job.py
hpdl cluster link b down                    pull host b's cable (and `up` to plug it back)
hpdl cluster down                           remove everything
"""

from __future__ import annotations

import argparse
import os
import sys

import hpdl.settings as settings

__all__ = ["rsh_main", "run_argv"]

RSH = "hpdl-cluster-rsh"
"""`hpdl cluster exec` as one program, for launchers that take a remote shell's path and no arguments (Hydra's
-launcher-exec, Open MPI's plm_rsh_agent): `hpdl-cluster-rsh [-x] HOST command...`; HPDL_CLUSTER names the cluster."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpdl cluster", description="A cluster of hosts on this machine (root).")
    parser.add_argument("--name", default="hpdl", help="the cluster's name (default hpdl)")
    verbs = parser.add_subparsers(dest="verb", required=True)
    up = verbs.add_parser("up", help="make the hosts (namespaces on a bridge)")
    up.add_argument("--hosts", type=int, default=2, help="how many hosts (a, b, ...; default 2)")
    up.add_argument("--link", help="shape each host's link to this rate (tc's units: 1gbit, 100mbit)")
    verbs.add_parser("down", help="remove every host, link and file of the cluster")
    verbs.add_parser("status", help="the hosts and their addresses")
    run = verbs.add_parser("exec", help="run a command on a host, as ssh would (Hydra's -launcher-exec)")
    run.add_argument("-x", action="store_true", help=argparse.SUPPRESS)  # what Hydra passes to ssh
    run.add_argument("host")
    run.add_argument("command", nargs=argparse.REMAINDER)
    link = verbs.add_parser("link", help="take a host's link down or up")
    link.add_argument("host")
    link.add_argument("state", choices=("up", "down"))
    return parser


def run_argv(argv: list[str]) -> int:
    from hpdl.runtime import sim_cluster

    options = _parser().parse_args(argv)
    if options.verb == "up":
        try:
            cluster = sim_cluster.up(options.hosts, options.link, options.name)
        except (RuntimeError, ValueError) as error:
            print(f"hpdl cluster: {error}", file=sys.stderr)
            return 1
        shaped = f", each link at {cluster.link}" if cluster.link else ""
        print(f"cluster {cluster.name}: {', '.join(f'{h} {a}' for h, a in cluster.addresses.items())}{shaped}")
        return 0
    if options.verb == "down":
        sim_cluster.down(options.name)
        return 0
    found = sim_cluster.load(options.name)
    if found is None:
        print(f"hpdl cluster: no cluster {options.name!r}: `hpdl cluster up` first", file=sys.stderr)
        return 1
    cluster = found
    if options.verb == "status":
        for host in cluster.hosts:
            print(f"{host}\t{cluster.addresses[host]}\t{cluster.link or 'unshaped'}")
        return 0
    if options.verb == "link":
        sim_cluster.set_link(cluster, options.host, options.state)
        return 0
    command = options.command[1:] if options.command[:1] == ["--"] else options.command
    if not command:
        print("hpdl cluster exec: name a command to run", file=sys.stderr)
        return 2
    try:
        argv = sim_cluster.exec_argv(cluster, options.host, command)
    except ValueError as error:
        print(f"hpdl cluster exec: {error}", file=sys.stderr)
        return 2
    why = sim_cluster.unreachable(cluster, options.host)
    if why:  # as ssh says it, and with its exit code
        print(f"ssh: {why}", file=sys.stderr)
        return 255
    # UCX (the mpich wheel's transport) sees one machine under every host and would move data between hosts
    # through shared memory, unshaped and unaffected by a link that is down: pinned to TCP unless chosen
    os.environ.setdefault("UCX_TLS", "tcp,self")
    os.execvp(argv[0], argv)
    return 127  # not reached


def rsh_main() -> int:
    """`hpdl-cluster-rsh [-x] HOST command...`: `hpdl cluster exec` under the name a launcher can call."""
    return run_argv(["--name", settings.text("HPDL_CLUSTER") or "hpdl", "exec", *sys.argv[1:]])
