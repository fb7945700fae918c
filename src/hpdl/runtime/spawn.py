"""Start N local ranks of a Python command and end them as one job.

One implementation serves `hpdl launch`, `hpdl demo` and the benchmarks:
MPI jobs go through the `mpiexec` installed beside this Python (the `mpich`
wheel) or the one on PATH; torch jobs get torchrun-style variables and a
rendezvous address. Every rank runs under `hpdl.runtime.run_rank`, so that a
non-zero exit ends the job like an exception does. If any rank fails, the
others are stopped and its exit code is returned; a job past its timeout is
stopped and returns 124; Ctrl-C stops every rank and returns 130.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Optional, Sequence

from hpdl.runtime.environment import free_port

__all__ = ["find_mpiexec", "job_environment", "rank_environment", "run"]

GRACE_SECONDS = 5.0
TIMED_OUT = 124
INTERRUPTED = 130
_OUTER_LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def find_mpiexec() -> str:
    """The mpiexec beside this Python (pip's `mpich`), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError(
            "no mpiexec found: `pip install mpich` (or load your cluster's MPI module), or use --backend torch"
        )
    return found


def job_environment(backend: str, nprocs: int, base: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The ranks' environment: the backend chosen, no launcher variables of an outer job, hpdl importable.

    OMP_NUM_THREADS defaults to the cores per rank (a caller's setting wins).
    """
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if not k.startswith(("PMI_", "PMIX_", "TORCHELASTIC_", "OMPI_")) and k not in _OUTER_LAUNCH
    }
    env["HPDL_BACKEND"] = backend
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nprocs)))
    import hpdl

    source = os.path.dirname(os.path.dirname(os.path.abspath(hpdl.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH", "")) if p)
    return env


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


def run(
    nprocs: int,
    target: Sequence[str],
    *,
    backend: str = "mpi",
    env: Optional[dict[str, str]] = None,
    tag_output: bool = False,
    timeout: Optional[float] = None,
    name: str = "hpdl launch",
) -> int:
    """Run `python -m hpdl.runtime.run_rank *target` on `nprocs` ranks and return the job's exit code.

    `target` is what follows `python` on a command line: a script and its
    arguments, or `-m module ...`.
    """
    command = [sys.executable, "-u", "-m", "hpdl.runtime.run_rank", *target]
    env = job_environment(backend, nprocs) if env is None else env
    if backend == "mpi":
        argv = [find_mpiexec(), "-n", str(nprocs)]
        if tag_output:
            argv += {"hydra": ["-prepend-rank"], "openmpi": ["--tag-output"]}.get(_mpiexec_flavour(argv[0]), [])
        children = [subprocess.Popen(argv + command, env=env)]
        pumps: list[threading.Thread] = []
    else:
        children, pumps = _spawn_torch(nprocs, command, env, tag_output)
    try:
        code = supervise(children, timeout, name)
    except KeyboardInterrupt:
        print(f"{name}: interrupted; stopping every rank", file=sys.stderr, flush=True)
        stop(children, signal.SIGINT)
        code = INTERRUPTED
    for pump in pumps:
        pump.join(timeout=GRACE_SECONDS)
    return code


def supervise(children: list[subprocess.Popen], timeout: Optional[float] = None, name: str = "hpdl launch") -> int:
    """Wait for every process; on the first failure (or the timeout) stop the rest and return its code."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [child.poll() for child in children]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            running = [child for child in children if child.poll() is None]
            if running:
                print(
                    f"{name}: rank {rank} exited with code {code}; stopping the other {len(running)} rank(s)",
                    file=sys.stderr,
                    flush=True,
                )
            stop(running, signal.SIGTERM)
            assert code is not None
            return code if code > 0 else 128 - code  # killed by signal N: report 128+N like a shell
        if all(code == 0 for code in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            print(f"{name}: stopped after the timeout of {timeout:g} s", file=sys.stderr, flush=True)
            stop(children, signal.SIGTERM)
            return TIMED_OUT
        time.sleep(0.05)


def stop(children: list[subprocess.Popen], first_signal: int) -> None:
    """Signal every process still running; kill those still there after the grace period."""
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


def _spawn_torch(
    nprocs: int, command: list[str], env: dict[str, str], tag_output: bool
) -> tuple[list[subprocess.Popen], list[threading.Thread]]:
    port = free_port()
    pipe = subprocess.PIPE if tag_output else None
    children, pumps = [], []
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
    return children, pumps


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


def _prefix_lines(source: IO[bytes], sink: IO[str], prefix: str) -> None:
    for raw in iter(source.readline, b""):
        sink.write(prefix + raw.decode(errors="replace"))
        sink.flush()
    source.close()
