"""A job's ranks on other hosts: through the site's MPI launcher, or one torchrun per host, over a remote shell.

The mpi backend goes through the MPI launcher beside this Python (Hydra's `-hosts` and `-launcher-exec`, Open
MPI's `-H` and `plm_rsh_agent`), which carries the environment to every rank. The torch backend starts one
`torchrun` per host through the remote shell (`rsh HOST env ... python -m torch.distributed.run ...`): node 0's
runs on the first host, whose agent serves the rendezvous store on the address this host uses toward the
others. A remote shell carries no environment, so the job's own settings go on its command line.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import IO

from hpdl.runtime.hosts import Hosts
from hpdl.runtime.processes import find_mpiexec, mpiexec_flavour, process_group, relabel_lines

__all__ = ["Remote", "spawn_mpi_hosts", "spawn_torch_hosts"]

ANSWER_SECONDS = 30.0
"""How long the clean-up after a failed job may try to reach a host (it runs after the launcher has ended)."""
_CARRIED = (
    "PYTHONPATH", "OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS", "THP_MEM_ALLOC_ENABLE",
    "UCX_TLS", "GLOO_SOCKET_IFNAME", "PATH",
)  # fmt: skip
"""Besides every HPDL_ variable, what the ranks on another host need of the launcher's environment."""


@dataclass(frozen=True)
class Remote:
    """The hosts of a job across machines and the remote shell that reaches them (ssh, or a stand-in)."""

    hosts: Hosts
    rsh: str

    def remove_leftovers(self, name: str) -> None:
        """On every host, the MPI segments a failed job's ranks left (hpdl.runtime.shm_leftovers: only files that
        nothing maps or holds open), in the background: a lost host's remote shell may take long to give up, and
        the launcher ends now. Each try is bounded (`timeout`)."""
        clean = [sys.executable, "-m", "hpdl.runtime.shm_leftovers", "--settle", "0.5"]
        bound = ["timeout", str(int(ANSWER_SECONDS))] if shutil.which("timeout") else []
        for host, _ in self.hosts.slots:
            try:
                subprocess.Popen(
                    [*bound, self.rsh, host, *clean], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
            except OSError as error:
                print(f"{name}: cannot reach host {host} to remove this job's MPI segments ({error})", file=sys.stderr)


def spawn_mpi_hosts(
    nprocs: int, command: list[str], env: dict[str, str], tag_output: bool, remote: Remote
) -> tuple[list[subprocess.Popen], list[threading.Thread]]:
    """The ranks on the hosts, through the site's launcher: Hydra's `-hosts` or Open MPI's `-H`, each with `rsh`.

    The ranks' output comes through the launcher (no descriptor crosses a remote shell), tagged with `[rank]`
    when asked. A rank on another host finds no job folder: it reports its failure as a first one.
    """
    mpiexec = find_mpiexec()
    flavour = mpiexec_flavour(mpiexec)
    spec = remote.hosts.spec(nprocs)
    if flavour == "openmpi":
        argv = [mpiexec, "-H", spec, "--mca", "plm_rsh_agent", remote.rsh, "-np", str(nprocs)]
        argv += ["--tag-output"] if tag_output else []
    else:  # Hydra (MPICH, MVAPICH, Intel MPI)
        argv = [mpiexec, "-hosts", spec, "-launcher", "ssh", "-launcher-exec", remote.rsh, "-n", str(nprocs)]
        argv += ["-prepend-rank"] if tag_output else []
    pipe = subprocess.PIPE if tag_output and flavour == "openmpi" else None
    child = subprocess.Popen(
        argv + command, env=env, stdout=pipe, stderr=pipe, stdin=subprocess.DEVNULL, **process_group(0)
    )
    child.hpdl_group = True  # type: ignore[attr-defined]
    pumps: list[threading.Thread] = []
    if pipe is not None:
        assert child.stdout is not None and child.stderr is not None
        for source, sink in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
            pump = threading.Thread(target=relabel_lines, args=(source, sink), daemon=True)
            pump.start()
            pumps.append(pump)
    return [child], pumps


def spawn_torch_hosts(
    nprocs: int, command: list[str], env: dict[str, str], tag_output: bool, remote: Remote
) -> tuple[list[subprocess.Popen], list[threading.Thread]]:
    """One torchrun per host, each starting its slots' ranks; node 0 (the first host) serves the store.

    `command` is `python [options] -u -m hpdl.runtime.run_rank target...`: torchrun runs the module part with this
    Python (interpreter options other than -u are not carried). Each host's output comes back through its remote
    shell (`agent_lines`), labelled `[host]` when asked."""
    placement = remote.hosts.placement(nprocs)
    address = master_address([host for host, _ in placement])
    with socket.socket() as probe:  # a free port on that address, for node 0's agent to bind
        probe.bind((address, 0))
        port = int(probe.getsockname()[1])
    module = command[command.index("-m") + 1 :]
    carried = {k: v for k, v in env.items() if k.startswith("HPDL_") or k in _CARRIED}
    children: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    pipe = subprocess.PIPE
    for node, (host, slots) in enumerate(placement):
        torchrun = [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(placement)}", f"--node-rank={node}",
            f"--nproc-per-node={slots}", f"--master-addr={address}", f"--master-port={port}", "-m", *module,
        ]  # fmt: skip
        line = ["cd", shlex.quote(os.getcwd()), "&&", "env", *(shlex.quote(f"{k}={v}") for k, v in carried.items())]
        line += [shlex.quote(word) for word in torchrun]
        group = process_group(children[0].pid if children else 0)
        child = subprocess.Popen(
            [remote.rsh, host, *line], env=env, stdout=pipe, stderr=pipe, stdin=subprocess.DEVNULL, **group
        )
        children.append(child)
        assert child.stdout is not None and child.stderr is not None
        for source, sink in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
            label = f"[{host}] " if tag_output else ""
            pump = threading.Thread(target=agent_lines, args=(source, sink, label), daemon=True)
            pump.start()
            pumps.append(pump)
    return children, pumps


_AGENT_FAILED = re.compile(r"^[EW]\d{4} [\d:.]+ +\d+ torch/distributed/elastic/.*(failed|exitcode)")
"""torchrun's own line when one of its ranks failed: what follows from it is its report (ChildFailedError)."""


def agent_lines(source: IO[bytes], sink: IO[str], label: str) -> None:
    """A host's torchrun output: its ranks' lines, `label` before each. Once torchrun says a rank failed, only the
    ranks' own `hpdl:` lines pass: the failing rank showed its error (hpdl.runtime.rank_failure) and torchrun's
    report of the same (its ChildFailedError traceback, some 40 lines a host) would bury it."""
    reporting = False
    for raw in iter(source.readline, b""):
        line = raw.decode(errors="replace")
        reporting = reporting or bool(_AGENT_FAILED.match(line))
        if not reporting or line.startswith("hpdl: "):
            sink.write(label + line)
            sink.flush()
    source.close()


def master_address(hosts: list[str]) -> str:
    """This host's address on the route toward the job's other hosts (never a lookup of its own name); loopback
    when the job has no other host."""
    from hpdl.runtime.addresses import route_source

    here = socket.gethostname()
    for host in hosts:
        if host in (here, "localhost"):
            continue
        try:
            peer = socket.gethostbyname(host)  # the names the user gave: ssh resolves them too
        except OSError as error:
            raise ValueError(f"host {host!r} does not resolve here ({error}); give its address instead") from None
        source = route_source(peer)
        if source is not None and not source.startswith("127."):
            return source
    return "127.0.0.1" if all(h in (here, "localhost") for h in hosts) else _no_route(hosts)


def _no_route(hosts: list[str]) -> str:
    raise ValueError(f"no route from this host to {', '.join(hosts)}: set HPDL_BIND_ADDR or run from one of them")
