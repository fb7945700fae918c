"""`hpdl launch -n N [--backend mpi|torch] script.py [args]`: start N local ranks and end them as one job.

MPI jobs go through the `mpiexec` installed beside this Python (the `mpich`
wheel) or the one on PATH; torch jobs get torchrun-style variables and a
rendezvous address. If any rank fails, the others are stopped and the
launcher returns that rank's exit code. Ctrl-C is forwarded to every rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import IO

from hpdl.runtime.environment import free_port

__all__ = ["add_parser", "run", "find_mpiexec", "rank_environment"]

GRACE_SECONDS = 5.0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="start N local ranks of a Python script",
        description="Start N local ranks of a script; stop them all if one fails.",
    )
    parser.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    parser.add_argument("--backend", choices=("mpi", "torch"), default="mpi", help="communication backend (mpi)")
    parser.add_argument("--tag-output", action="store_true", help="prefix every output line with its rank")
    parser.add_argument("--timeout", type=float, help="seconds any collective may wait (HPDL_TIMEOUT)")
    parser.add_argument("--debug", action="store_true", help="compare collective fingerprints (HPDL_DEBUG=1)")
    parser.add_argument("-m", dest="module", help="run a module (like python -m) instead of a script")
    parser.add_argument("script", nargs="?", help="the script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(handler=run)


def run(options: argparse.Namespace) -> int:
    if options.nprocs < 1:
        print(f"hpdl launch: -n {options.nprocs}: need at least one rank", file=sys.stderr)
        return 2
    if options.module:
        target = ["-m", options.module] + ([options.script] if options.script else []) + options.args
    elif options.script:
        if not os.path.exists(options.script):
            print(f"hpdl launch: script {options.script!r} not found", file=sys.stderr)
            return 2
        target = [options.script] + options.args
    else:
        print("hpdl launch: name a script (or -m module) to run", file=sys.stderr)
        return 2
    env = dict(os.environ, HPDL_BACKEND=options.backend)
    if options.timeout is not None:
        env["HPDL_TIMEOUT"] = str(options.timeout)
    if options.debug:
        env["HPDL_DEBUG"] = "1"
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // options.nprocs)))
    # Each rank runs under run_rank: sys.exit(N != 0) then ends the job at once, like an exception.
    command = [sys.executable, "-u", "-m", "hpdl.runtime.run_rank"] + target
    if options.backend == "mpi":
        return launch_mpi(options.nprocs, command, env, options.tag_output)
    return launch_torch(options.nprocs, command, env, options.tag_output)


def find_mpiexec() -> str:
    """The mpiexec beside this Python (pip's `mpich`), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError(
            "no mpiexec found: `pip install mpich` (or load your cluster's MPI module), or use --backend torch"
        )
    return found


def _mpiexec_flavour(mpiexec: str) -> str:
    try:
        text = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "HYDRA" in text.upper():
        return "hydra"
    if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text:
        return "openmpi"
    return "unknown"


def launch_mpi(nprocs: int, command: list[str], env: dict[str, str], tag_output: bool) -> int:
    mpiexec = find_mpiexec()
    argv = [mpiexec, "-n", str(nprocs)]
    if tag_output:
        flavour = _mpiexec_flavour(mpiexec)
        argv += {"hydra": ["-prepend-rank"], "openmpi": ["--tag-output"]}.get(flavour, [])
    child = subprocess.Popen(argv + command, env=env)
    try:
        return child.wait()
    except KeyboardInterrupt:
        return _interrupt([child])


def rank_environment(env: dict[str, str], rank: int, size: int, address: str, port: int) -> dict[str, str]:
    """torchrun-style variables for one local rank."""
    return dict(
        env,
        RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR=address,
        MASTER_PORT=str(port),
    )


def launch_torch(nprocs: int, command: list[str], env: dict[str, str], tag_output: bool) -> int:
    port = free_port()
    pipe = subprocess.PIPE if tag_output else None
    children = []
    pumps = []
    for rank in range(nprocs):
        child = subprocess.Popen(
            command, env=rank_environment(env, rank, nprocs, "127.0.0.1", port), stdout=pipe, stderr=pipe
        )
        children.append(child)
        if tag_output:
            assert child.stdout is not None and child.stderr is not None
            for source, sink in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
                pump = threading.Thread(target=_prefix_lines, args=(source, sink, f"[{rank}] "), daemon=True)
                pump.start()
                pumps.append(pump)
    try:
        code = supervise(children)
    except KeyboardInterrupt:
        code = _interrupt(children)
    for pump in pumps:
        pump.join(timeout=GRACE_SECONDS)
    return code


def supervise(children: list[subprocess.Popen]) -> int:
    """Wait for every rank; on the first failure stop the rest and return the failing exit code."""
    while True:
        codes = [child.poll() for child in children]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            running = [child for child in children if child.poll() is None]
            if running:
                print(
                    f"hpdl launch: rank {rank} exited with code {code}; stopping the other {len(running)} rank(s)",
                    file=sys.stderr,
                    flush=True,
                )
            _stop(running, signal.SIGTERM)
            return code if code > 0 else 128 - code  # killed by signal N: report 128+N like a shell
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.05)


def _interrupt(children: list[subprocess.Popen]) -> int:
    print("hpdl launch: interrupted; stopping every rank", file=sys.stderr, flush=True)
    _stop(children, signal.SIGINT)
    return 130


def _stop(children: list[subprocess.Popen], first_signal: int) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(first_signal)
    deadline = time.monotonic() + GRACE_SECONDS
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _prefix_lines(source: IO[bytes], sink: IO[str], prefix: str) -> None:
    for raw in iter(source.readline, b""):
        sink.write(prefix + raw.decode(errors="replace"))
        sink.flush()
    source.close()
