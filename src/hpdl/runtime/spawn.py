"""Start N local ranks of a Python command and end them as one job.

One implementation serves `hpdl launch`, `hpdl demo` and the benchmarks:
MPI jobs go through the `mpiexec` installed beside this Python (the `mpich`
wheel) or the one on PATH; torch jobs get torchrun-style variables and a
rendezvous address. Every rank runs under `hpdl.runtime.run_rank`, so that a
non-zero exit ends the job like an exception does. If any rank fails, the
others are stopped and its exit code is returned; a job past its timeout is
stopped and returns 124; Ctrl-C stops every rank and returns 130.

A local job listens on loopback only: MPI jobs of the `mpich` wheel start
under its forking process manager (`mpiexec.gforker`: no control port,
where Hydra's listens on every interface), the MPI and gloo transports are
told to use the loopback interface, and the torch rendezvous store binds
127.0.0.1 (`hpdl.runtime.store.rendezvous_store`). A setting the caller
made (UCX_NET_DEVICES, GLOO_SOCKET_IFNAME, ...) wins.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any, Iterator, Optional, Sequence

from hpdl.runtime.environment import STORE_FD, loopback_interface
from hpdl.runtime.hosts import Hosts
from hpdl.runtime.processes import find_mpiexec, mpiexec_flavour, process_group, relabel_lines, tag_lines
from hpdl.runtime.rank_failure import JOB_DIR, first_failure, mark_interrupted
from hpdl.runtime.rank_faults import FAULT_SIGNALS, RANK_FAULT_FDS, RankFaults
from hpdl.runtime.rank_output import RANK_OUTPUT_FDS, rank_outputs
from hpdl.runtime.remote import Remote, spawn_mpi_hosts, spawn_torch_hosts

__all__ = [
    "LOOPBACK_SETTINGS",
    "STORE_FD",
    "find_mpiexec",
    "forker_segment_prefix",
    "job_environment",
    "local_mpiexec",
    "mpiexec_argv",
    "rank_environment",
    "remove_forker_segments",
    "run",
    "store_listener",
]

GRACE_SECONDS = 5.0
FAILED_JOB_GRACE = 6.0
"""Seconds a job may take to end once a rank has reported its failure (the launcher stops it then): long enough
for the other reachable ranks to reach their own timeout and say so on a loaded machine (a lost host's ranks and
this host's time out together, give or take a progress-board read of 2 s)."""
TIMED_OUT = 124
INTERRUPTED = 130
_OUTER_LAUNCH = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PRTE_LAUNCHED",  # Open MPI 5's launcher marks its ranks with these two
    "OPAL_USER_PARAMS_GIVEN",
)
_OPEN_MPI_USER_SETTINGS = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")
"""Open MPI's variables that are not a job's own: its launcher refuses root without them (containers run as root)."""
_OPEN_MPI_JOB_MCA = (
    "OMPI_MCA_num_procs",
    "OMPI_MCA_initial_wdir",
    "OMPI_MCA_cpu_type",
    "OMPI_MCA_orte_",
    "OMPI_MCA_ess",
    "OMPI_MCA_pmix",
    "OMPI_MCA_mpi_oversubscribe",
    "OMPI_MCA_shmem_RUNTIME_QUERY_hint",
)
"""The OMPI_MCA_ variables Open MPI's launchers (4.x, 5.x) give their ranks; every other OMPI_MCA_ is the user's."""
LOOPBACK_SETTINGS = (
    "UCX_NET_DEVICES",  # MPICH over UCX (the mpich wheel)
    "FI_TCP_IFACE",  # MPICH over libfabric
    "FI_SOCKETS_IFACE",
    "OMPI_MCA_btl_tcp_if_include",  # Open MPI
    "OMPI_MCA_oob_tcp_if_include",  # (Open MPI 5's launcher refuses a loopback-only control channel: not set)
    "GLOO_SOCKET_IFNAME",  # torch.distributed's gloo
)
"""Each names the interface its transport may listen on; a local job sets them all to loopback."""
_RETURN_CODE = re.compile(r"^\[\d+\](\d+):Return code = (-?\d+)(?:, signaled with (.+?))?\s*$")
"""gforker's report of each rank's exit once one has failed."""


def mpiexec_argv(nprocs: int) -> list[str]:
    """`mpiexec -n N` for N ranks on this machine, with what its flavour needs to start more ranks than cores."""
    mpiexec = find_mpiexec()
    return [mpiexec, "-n", str(nprocs), *_oversubscribe(mpiexec_flavour(mpiexec))]


def _oversubscribe(flavour: str) -> list[str]:
    """Open MPI counts cores as slots and refuses more ranks than that, where MPICH runs them."""
    return ["--oversubscribe"] if flavour == "openmpi" else []


def threads_per_rank(ranks_here: int) -> int:
    """This host's cores over the ranks it runs (at least 1)."""
    return max(1, (os.cpu_count() or 1) // max(1, ranks_here))


TF_THREAD_VARIABLES = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")
"""TensorFlow's own settings of its thread pools' sizes (read when its runtime starts)."""


def job_environment(
    backend: str, nprocs: int, base: Optional[dict[str, str]] = None, hosts: Optional[Hosts] = None
) -> dict[str, str]:
    """The ranks' environment: the backend chosen, no launcher variables of an outer job, hpdl importable.

    OMP_NUM_THREADS defaults to the cores per rank, and TensorFlow's two thread pools get the same number
    (TF_NUM_INTRAOP_THREADS, TF_NUM_INTEROP_THREADS: TensorFlow ignores OMP_NUM_THREADS, and every rank's pools
    would take the whole machine; docs/keras.md has the cost). torch's CPU allocator puts tensors of 2 MB and
    more on transparent huge pages (THP_MEM_ALLOC_ENABLE=1): with 4 KB pages every step's fresh activations
    cost a page fault per 4 KB (a 2048 x 2048 CNN step: 1.1 million faults, 2.1 s of kernel time against 0.9 s
    of compute; with huge pages 15,000 faults and 0.3 s). A caller's setting wins for each.
    """
    env = {k: v for k, v in (os.environ if base is None else base).items() if not _outer_launch_variable(k)}
    env["HPDL_BACKEND"] = backend
    per_host = max(n for _, n in hosts.placement(nprocs)) if hosts else nprocs
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(per_host)))
    for name in TF_THREAD_VARIABLES:
        env.setdefault(name, env["OMP_NUM_THREADS"])
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if hosts is None:  # across hosts the transports take the interfaces that reach the others, as they choose
        loopback = loopback_interface()
        for name in LOOPBACK_SETTINGS:
            env.setdefault(name, loopback)
        # Open MPI's TCP transport listens on every interface whatever it is told to use; local ranks meet in
        # shared memory without it.
        env.setdefault("OMPI_MCA_btl", "^tcp")
    source = str(Path(os.path.abspath(__file__)).parents[2])  # the folder that holds the package hpdl
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source, env.get("PYTHONPATH", "")) if p)
    return env


def _outer_launch_variable(name: str) -> bool:
    """Whether `name` is a variable an outer job's launcher set for its ranks (which would confuse this job's).

    Open MPI's own settings are the user's and stay: OMPI_MCA_* (a transport, a component left out) and
    OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM), without which its launcher refuses to run as root, as in most containers.
    """
    if name in _OUTER_LAUNCH or name.startswith(("PMI_", "PMIX_", "TORCHELASTIC_")):
        return True
    if name.startswith("OMPI_MCA_"):
        return name.startswith(_OPEN_MPI_JOB_MCA)
    return name.startswith("OMPI_") and name not in _OPEN_MPI_USER_SETTINGS


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
    python_options: Sequence[str] = (),
    hosts: Optional[Hosts] = None,
    rsh: str = "ssh",
) -> int:
    """Run `python -m hpdl.runtime.run_rank *target` on `nprocs` ranks and return the job's exit code.

    `target` is what follows `python` on a command line: a script and its
    arguments, or `-m module ...`; `python_options` (`-O`, `-X dev`, ...) go to
    every rank's interpreter. With `hosts`, the ranks run on those hosts (MPI
    only), started through the remote shell `rsh`.
    """
    command = [sys.executable, *python_options, "-u", "-m", "hpdl.runtime.run_rank", *target]
    env = job_environment(backend, nprocs) if env is None else env
    job_dir = tempfile.mkdtemp(prefix="hpdl-job-")
    try:
        with _terminate_as_interrupt():
            job = {**env, JOB_DIR: job_dir}
            return _run_job(
                nprocs, command, backend, job, tag_output, timeout, name, Remote(hosts, rsh) if hosts else None
            )
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM to the launcher (a batch system's, a test's) stops the job as Ctrl-C does, clean-up included."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_job(
    nprocs: int,
    command: list[str],
    backend: str,
    env: dict[str, str],
    tag_output: bool,
    timeout: Optional[float],
    name: str,
    remote: Optional[Remote] = None,
) -> int:
    if remote is not None:
        spawner = spawn_mpi_hosts if backend == "mpi" else spawn_torch_hosts
        children, pumps = spawner(nprocs, command, env, tag_output, remote)
    elif backend == "mpi":
        children, pumps = _spawn_mpi(nprocs, command, env, tag_output)
    else:
        children, pumps = _spawn_torch(nprocs, command, env, tag_output)
    stopped_here = False
    try:
        code = supervise(children, timeout, name, env.get(JOB_DIR))
        stopped_here = code == TIMED_OUT
    except KeyboardInterrupt:
        print(f"{name}: interrupted; stopping every rank", file=sys.stderr, flush=True)
        mark_interrupted(env[JOB_DIR])
        stop(children, signal.SIGINT)
        code, stopped_here = INTERRUPTED, True
    for pump in pumps:
        pump.join(timeout=GRACE_SECONDS)
    for child in children:
        faults = getattr(child, "hpdl_faults", None)
        if faults is not None:
            code = faults.settle(code, name, GRACE_SECONDS)
        if not stopped_here:  # else the signals are the launcher's own
            code = _said_exits(getattr(child, "hpdl_ended", {}), code, env[JOB_DIR], name)
        if getattr(child, "hpdl_forker", False):
            remove_forker_segments(child.pid)  # left behind where ranks were killed
    if remote is not None and code != 0:
        remote.remove_leftovers(name)
    return code


def remove_forker_segments(pid: int, root: str = "/dev/shm") -> list[str]:
    """Unlink the shared-memory files MPICH names after the `mpiexec.gforker` whose pid this is; return them.

    MPICH names a job's node segment `mpich_shm_<world id>_<node>` (and `mpich_vci_...`), the world id
    being the FNV-1a hash of the PMI key-value space's name, which gforker makes `kvs_<its pid>_0`. A job
    whose ranks were killed leaves its files behind, and a later gforker that gets the same pid (pids wrap
    at 32768 on many machines) opened the dead job's segment at MPI_Init: its leftover messages failed
    the init ("Message from rank 1 and tag 7 truncated") or could have been read as data. The name is
    this job's alone while its gforker lives, so removing it before the ranks start and after they end is
    safe beside other jobs.
    """
    removed = []
    for pattern in (f"{forker_segment_prefix(pid)}*", f"{forker_segment_prefix(pid, 'mpich_vci_')}*"):
        for path in glob.glob(os.path.join(root, pattern)):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass  # gone already, or not ours to remove
    return removed


def forker_segment_prefix(pid: int, kind: str = "mpich_shm_") -> str:
    """The start of the names MPICH gives the shared-memory files of the job that `mpiexec.gforker` `pid` runs."""
    return f"{kind}{_fnv1a(f'kvs_{pid}_0'):x}_"


def _fnv1a(text: str) -> int:
    """32-bit FNV-1a, as MPICH hashes the PMI kvs name into its world id."""
    value = 2166136261
    for byte in text.encode():
        value = ((value ^ byte) * 16777619) & 0xFFFFFFFF
    return value


def supervise(
    children: list[subprocess.Popen],
    timeout: Optional[float] = None,
    name: str = "hpdl launch",
    job_dir: Optional[str] = None,
) -> int:
    """Wait for every process; on the first failure (or the timeout) stop the rest and return its code.

    A rank that reported its failure in `job_dir` (`hpdl.runtime.rank_failure`) has said why; the others say
    where they were stopped."""
    deadline = None if timeout is None else time.monotonic() + timeout
    failed_at: Optional[float] = None
    while True:
        codes = [child.poll() for child in children]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            running = [child for child in children if child.poll() is None]
            if running and (job_dir is None or first_failure(job_dir) is None):
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
        if job_dir is not None and failed_at is None and first_failure(job_dir) is not None:
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAILED_JOB_GRACE:
            # an MPI launcher that cannot reach a lost host waits for it (Hydra, for ever): the job is over
            print(
                f"{name}: the job has not ended {FAILED_JOB_GRACE:g} s after {first_failure(job_dir)}; stopping it "
                "(a host may be unreachable)",
                file=sys.stderr,
                flush=True,
            )
            stop(children, signal.SIGKILL)  # its ranks have said why; what still runs waits on the lost host
            return 1
        time.sleep(0.05)


def stop(children: list[subprocess.Popen], first_signal: int) -> None:
    """Signal every process still running; kill those still there after the grace period."""
    for child in children:
        if child.poll() is None:
            _signal(child, first_signal)
    deadline = time.monotonic() + GRACE_SECONDS
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(child, signal.SIGKILL)
            child.wait()
        if getattr(child, "hpdl_group", False):
            _signal(child, signal.SIGKILL)  # ranks the MPI launcher left behind when it went


def _signal(child: subprocess.Popen, signum: int) -> None:
    """Signal a child, or its whole process group where it leads one (an MPI launcher and its ranks)."""
    try:
        if getattr(child, "hpdl_group", False):
            os.killpg(child.pid, signum)
        else:
            child.send_signal(signum)
    except ProcessLookupError:
        pass


def local_mpiexec() -> tuple[str, str]:
    """The MPI launcher for ranks on this machine, and its flavour ('gforker', 'hydra', 'openmpi', ...).

    Beside the `mpich` wheel's Hydra lies its forking process manager, which starts local ranks
    without a control port on the network: it is preferred for local jobs.
    """
    mpiexec = find_mpiexec()
    flavour = mpiexec_flavour(mpiexec)
    forker = os.path.join(os.path.dirname(mpiexec), "mpiexec.gforker")
    if flavour == "hydra" and os.access(forker, os.X_OK):
        return forker, "gforker"
    return mpiexec, flavour


def _spawn_mpi(
    nprocs: int, command: list[str], env: dict[str, str], tag_output: bool
) -> tuple[list[subprocess.Popen], list[threading.Thread]]:
    mpiexec, flavour = local_mpiexec()
    argv = [mpiexec, "-n", str(nprocs), *_oversubscribe(flavour)]
    if tag_output:
        argv += {"gforker": ["-l"], "hydra": ["-prepend-rank"], "openmpi": ["--tag-output"]}.get(flavour, [])
    pipe = subprocess.PIPE if flavour == "gforker" or (tag_output and flavour == "openmpi") else None
    pumps: list[threading.Thread] = []
    fds: tuple[int, ...] = ()
    faults = None
    ended: dict[int, tuple[int, int]] = {}
    if flavour != "gforker":  # the others stop the job with MPI_Abort, which their launchers expect
        env = {k: v for k, v in env.items() if k != JOB_DIR}
    else:  # its relay drops a rank's output at the first non-ASCII byte
        # every rank on this host: the locality variables Hydra and torchrun give (run_rank adds each rank's own)
        env = {**env, "MPI_LOCALNRANKS": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs)}
        outputs = rank_outputs(nprocs, tag_lines if tag_output else None)
        env, fds, pumps = {**env, RANK_OUTPUT_FDS: outputs.value}, outputs.fds, outputs.pumps
        faults = RankFaults(nprocs)  # it exits 0 when a signal killed a rank
        env, fds = {**env, RANK_FAULT_FDS: faults.value}, fds + faults.fds
    # Its own process group, so that stopping the job reaches every rank, not only the launcher.
    try:
        child = subprocess.Popen(argv + command, env=env, stdout=pipe, stderr=pipe, pass_fds=fds, **process_group(0))
    finally:
        for fd in fds:
            os.close(fd)
    child.hpdl_group = True  # type: ignore[attr-defined]
    child.hpdl_faults = faults  # type: ignore[attr-defined]
    child.hpdl_ended = ended  # type: ignore[attr-defined]
    if flavour == "gforker":
        remove_forker_segments(child.pid)  # a dead job's, whose launcher had this pid
        child.hpdl_forker = True  # type: ignore[attr-defined]
    if pipe is not None:
        assert child.stdout is not None and child.stderr is not None
        for source, sink in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
            relay: tuple[Any, ...] = (_launcher_lines, ended) if flavour == "gforker" else (relabel_lines,)
            pump = threading.Thread(target=relay[0], args=(source, sink, *relay[1:]), daemon=True)
            pump.start()
            pumps.append(pump)
    return [child], pumps


def _spawn_torch(
    nprocs: int, command: list[str], env: dict[str, str], tag_output: bool
) -> tuple[list[subprocess.Popen], list[threading.Thread]]:
    store, port = store_listener()
    pipe = subprocess.PIPE if tag_output else None
    children: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    for rank in range(nprocs):
        group = process_group(children[0].pid if children else 0)  # one group for the job, as under MPI
        rank_env = rank_environment(env, rank, nprocs, "127.0.0.1", port)
        # Every rank's env:// rendezvous (torch's own init_process_group) connects to rank 0's server as a client,
        # rank 0's too (store.serve_handed_store): the same way on every rank, since torch 2.4 puts the keys
        # of that way under a prefix that names the restart (a rank 0 alone with it waited for ever)
        rank_env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        rank_env.setdefault("TORCHELASTIC_RESTART_COUNT", "0")
        fds: tuple[int, ...] = ()
        if rank == 0:
            rank_env[STORE_FD] = str(store.fileno())
            fds = (store.fileno(),)
        child = subprocess.Popen(command, env=rank_env, stdout=pipe, stderr=pipe, pass_fds=fds, **group)
        children.append(child)
        if tag_output:
            assert child.stdout is not None and child.stderr is not None
            for source, sink in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
                pump = threading.Thread(target=tag_lines, args=(source, sink, rank), daemon=True)
                pump.start()
                pumps.append(pump)
    store.close()  # rank 0 holds it now
    return children, pumps


def store_listener() -> tuple[socket.socket, int]:
    """A socket listening on 127.0.0.1 for rank 0's rendezvous store, and its port.

    The launcher binds it and hands it to rank 0 (STORE_FD), so no other process can take the
    port between choosing it and listening on it, as it could with a port that was only probed.
    """
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    return listener, int(listener.getsockname()[1])


def _launcher_lines(source: IO[bytes], sink: IO[str], ended: dict[int, tuple[int, int]]) -> None:
    """MPICH's forking launcher's own output (the ranks' goes around it) without its `[0]1:Return code = 0,
    signaled with Quit` line per rank: a failing rank says why itself. What the lines say goes to `ended`
    (rank -> (exit code, signal number or 0)) for `_said_exits`."""
    for raw in iter(source.readline, b""):
        line = raw.decode(errors="replace")
        found = _RETURN_CODE.match(line)
        if not found:
            sink.write(line)
            sink.flush()
        else:
            ended[int(found.group(1))] = (int(found.group(2)), _SIGNAL_NAMES.get(found.group(3) or "", 0))
    source.close()


_SIGNAL_NAMES = {signal.strsignal(s): int(s) for s in signal.valid_signals() if signal.strsignal(s)}
"""'Killed' -> 9, as the C library names signals (gforker's "signaled with Killed")."""


def _said_exits(ended: dict[int, tuple[int, int]], code: int, job_dir: str, name: str) -> int:
    """A rank killed from outside (the OOM killer, a batch system, `kill -9`), which gforker reports with exit code
    0 and which cannot say it itself: said, and 128 + the signal's number is the job's code."""
    if first_failure(job_dir) is not None:
        return code  # the rank that failed first said why, and its code is the job's
    killed = [(rank, number) for rank, (_, number) in sorted(ended.items()) if number not in _STOPPING]
    for rank, number in killed:
        if number not in FAULT_SIGNALS:  # RankFaults says those, with the rank's traceback
            print(f"{name}: rank {rank} was killed by {signal.Signals(number).name}", file=sys.stderr, flush=True)
    return 128 + killed[0][1] if killed else code


_STOPPING = (0, signal.SIGINT, signal.SIGQUIT)
"""No signal, or one gforker sends the other ranks once one has ended with a non-zero code."""
