"""The torch rendezvous across hosts whose names resolve nowhere useful: a simulated cluster of two hosts
(hpdl.runtime.sim_cluster: network namespaces on a bridge), plain MPICH Hydra, no MASTER_ADDR or HPDL_BIND_ADDR.

Each host's /etc/hosts is Debian's: its own name is 127.0.1.1, the other host's name is unknown. Resolving rank
0's host name, the store listened on 127.0.1.1 (or raised socket.gaierror) and the other host's ranks retried
resolving "a" for the whole store timeout; the ranks now agree over MPI on rank 0's address that every rank
reaches (hpdl.runtime.addresses).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpdl.runtime import sim_cluster

SCRIPT = r"""
import socket, time
start = time.time()
import hpdl, hpdl.interop  # noqa: F401 (registers the "hpdl" backend)
import torch, torch.distributed as dist

dist.init_process_group("hpdl")
total = torch.full((3,), float(dist.get_rank() + 1))
dist.all_reduce(total)
store = dist.distributed_c10d._get_default_store()
while hasattr(store, "underlying_store"):
    store = store.underlying_store
listening = []
if dist.get_rank() == 0:  # the store's listener, from the kernel's table: its local address, never 0.0.0.0
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, port = local.split(":")
        if state == "0A" and int(port, 16) == store.port:
            listening.append(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
comm = hpdl.init("torch")
ones = comm.allreduce(torch.ones(2)).tolist()
with open(f"result.{dist.get_rank()}", "w") as out:  # (mpiexec's merged output can mix ranks' lines)
    out.write(f"{socket.gethostname()} {dist.get_rank()} {total.tolist()} {store.host} {listening} "
              f"{comm.rank}/{comm.size} local {comm.local_size} {ones} {time.time() - start:.1f}s")
"""


def test_torch_rendezvous_across_hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    why = sim_cluster.available()
    if why:
        pytest.skip(why)
    name = "hpdlr" + os.environ.get("PYTEST_XDIST_WORKER", "")
    cluster = sim_cluster.up(2, name=name)
    try:
        for host in cluster.hosts:  # Debian's: its own name on 127.0.1.1, no other host named
            with open(f"/etc/netns/{cluster.namespace(host)}/hosts", "w") as out:
                out.write(f"127.0.0.1\tlocalhost\n127.0.1.1\t{host}\n")
        (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
        monkeypatch.chdir(tmp_path)  # the hosts' working folder (a shared file system)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "HPDL_", "GLOO_", "TORCH"))}
        env.update(HPDL_CLUSTER=name, PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
        env["HPDL_TIMEOUT"] = "60"
        a = cluster.addresses["a"]
        # -localhost: Hydra's proxy on b cannot resolve "a" either (UCX_TLS: inter-host data over TCP)
        command = (
            f"UCX_TLS=tcp,self {os.path.join(os.path.dirname(sys.executable), 'mpiexec')} -localhost {a} "
            f"-hosts a:2,b:2 -launcher ssh -launcher-exec {sim_cluster.remote_shell()} "
            f"-n 4 {sys.executable} script.py"
        )
        output = _run(sim_cluster.exec_argv(cluster, "a", [command]), env)
    finally:
        sim_cluster.down(name)
    results = [tmp_path / f"result.{rank}" for rank in range(4)]
    lines = [result.read_text().split() for result in results if result.exists()]
    assert len(lines) == 4, output
    for rank, line in enumerate(lines):
        assert line[:6] == ["a" if rank < 2 else "b", str(rank), "[10.0,", "10.0,", "10.0]", a], line
        assert line[6:] == [f"['{a}']" if rank == 0 else "[]", f"{rank}/4", "local", "2", "[4.0,", "4.0]", line[-1]]


def _run(argv: list[str], env: dict[str, str], timeout: float = 120) -> str:
    """The command's output; on a timeout, every process of its session killed first (mpiexec, its proxies on
    both hosts and the ranks), then a failure with what it said."""
    with subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as job:
        try:
            output = job.communicate(timeout=timeout)[0]
        except subprocess.TimeoutExpired:
            _kill_session(job.pid)
            pytest.fail(f"no result in {timeout:.0f} s:\n{job.communicate()[0][-4000:]}")
    assert job.returncode == 0, output
    return output


def _kill_session(session: int) -> None:
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            if int(fields[3]) == session:  # the session id (after state, ppid, pgrp)
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            pass
