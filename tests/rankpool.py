"""Run test bodies on K real ranks and bring every rank's result back to the pytest process.

Starting ranks costs seconds, so a pool of K ranks (one `mpiexec -n K`, or K
torch.distributed processes) is started once per (backend, K, environment)
and serves many test bodies. A body is a module-level function
`body(comm, *args)`; the pool sends it by reference (module and name) to
every rank, runs it there, and returns the list of per-rank results, so that
assertions run here. Every wait is bounded: a rank that does not answer in
time kills the pool and fails the test with what each rank printed.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener
from typing import Any, Callable, Optional

from hpdl.runtime.spawn import STORE_FD, mpiexec_argv, rank_environment, store_listener

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(TESTS_DIR, "rank_worker.py")
START_TIMEOUT = 60.0
# Errors after which the engine may hold pending operations: the pool is not reused.
POISONING = {"CommTimeoutError", "CommError"}


@dataclass
class RankError:
    """An exception raised by a body on one rank (returned when the test expects errors)."""

    rank: int
    type_name: str
    message: str
    traceback: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.type_name}: {self.message}"


class RankPool:
    """K ranks of one backend waiting for test bodies."""

    def __init__(self, backend: str, nprocs: int, env: Optional[dict[str, str]] = None):
        self.backend = backend
        self.nprocs = nprocs
        key = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=key, backlog=64)
        host, port = self._listener.address
        child_env = dict(os.environ, OMP_NUM_THREADS="1", HPDL_BACKEND=backend, **(env or {}))
        child_env["GLIBC_TUNABLES"] = huge_page_heap(child_env.get("GLIBC_TUNABLES"))
        child_env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, child_env.get("PYTHONPATH", "")])
        # the ranks' temporary files in a folder of the pool's: they leave with os._exit, which skips the atexit
        # handlers that remove them (TensorFlow's autograph wrote 32 sources per suite run into /tmp and left them)
        self._tmp = tempfile.mkdtemp(prefix="hpdl-pool-")
        child_env["TMPDIR"] = self._tmp
        command = [sys.executable, "-u", WORKER, host, str(port), key.hex()]
        self._log_path = os.path.join(_log_dir(), f"pool-{backend}-{nprocs}-{os.getpid()}-{time.time_ns()}.log")
        log = open(self._log_path, "w")
        self._logs = [log]
        if backend == "mpi":
            self._procs = [subprocess.Popen(mpiexec_argv(nprocs) + command, env=child_env, stdout=log, stderr=log)]
        else:
            store, port_ = store_listener()  # rank 0's rendezvous store serves on it: no port race
            self._procs = []
            for r in range(nprocs):
                env_r = rank_environment(child_env, r, nprocs, "127.0.0.1", port_)
                fds = (store.fileno(),) if r == 0 else ()
                if r == 0:
                    env_r[STORE_FD] = str(store.fileno())
                self._procs.append(subprocess.Popen(command, env=env_r, stdout=log, stderr=log, pass_fds=fds))
            store.close()
        self._conns: list[Optional[Connection]] = [None] * nprocs
        self.alive = True
        self._exit_requested = False
        # Listener.accept cannot time out: accept in a thread and bound the wait here.
        acceptor = threading.Thread(target=self._accept_all, daemon=True)
        acceptor.start()
        acceptor.join(START_TIMEOUT)
        if acceptor.is_alive() or None in self._conns:
            self.kill()
            raise TimeoutError(f"{backend} pool of {nprocs} did not start within {START_TIMEOUT} s:\n{self.output()}")

    def _accept_all(self) -> None:
        accepted = 0
        while accepted < self.nprocs:
            try:
                conn = self._listener.accept()
                self._conns[conn.recv()] = conn
                accepted += 1
            except OSError as exc:
                if not self.alive:
                    return  # the listener was closed because the start timed out
                print(f"rank pool: a connection failed ({exc!r}); waiting for the next", file=sys.stderr)

    def run(self, body: Callable[..., Any], *args: Any, timeout: float = 60.0, expect_errors: bool = False) -> list:
        """Run `body(comm, *args)` on every rank; return the results ordered by rank.

        With `expect_errors`, a rank's exception comes back as a `RankError`;
        otherwise any exception fails the test with that rank's traceback.
        """
        for conn in self._conns:
            assert conn is not None
            conn.send_bytes(pickle.dumps(("run", body, args)))
        results: list[Any] = []
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(self._conns):
            assert conn is not None
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.kill()
                raise TimeoutError(
                    f"rank {rank} of the {self.backend} pool gave no answer to {body.__name__} within "
                    f"{timeout} s; output:\n{self.output()}"
                )
            try:
                kind, payload = pickle.loads(conn.recv_bytes())
            except EOFError:
                self.kill()
                raise RuntimeError(f"rank {rank} of the {self.backend} pool died; output:\n{self.output()}") from None
            results.append(payload if kind == "ok" else RankError(rank, *payload))
        errors = [r for r in results if isinstance(r, RankError)]
        if any(e.type_name in POISONING for e in errors):
            self.kill()
        if errors and not expect_errors:
            details = "\n".join(f"--- rank {e.rank} ---\n{e.traceback}" for e in errors)
            raise AssertionError(f"{body.__name__} failed on {len(errors)} rank(s):\n{details}")
        return results

    def output(self) -> str:
        for log in self._logs:
            if not log.closed:
                log.flush()
        with open(self._log_path) as handle:
            return handle.read()[-30000:]

    def request_exit(self) -> None:
        """Ask every rank to leave (finalize and exit) without waiting: pools then end side by side."""
        if self.alive and not self._exit_requested:
            self._exit_requested = True
            for conn in self._conns:
                try:
                    if conn is not None:
                        conn.send_bytes(pickle.dumps(("exit", None, None)))
                except OSError:
                    pass

    def close(self) -> None:
        """End the pool. A pool whose ranks all left cleanly leaves no log behind; one that failed keeps its log
        (in _log_dir(), named by backend and ranks) for a look afterwards."""
        codes: list[Optional[int]] = []
        if self.alive:
            self.request_exit()
            for proc in self._procs:
                try:
                    codes.append(proc.wait(timeout=30))
                except subprocess.TimeoutExpired:
                    codes.append(None)
        self.kill()
        if codes and all(code == 0 for code in codes):
            with contextlib.suppress(OSError):  # (a temporary directory cleaned meanwhile)
                os.remove(self._log_path)

    def kill(self) -> None:
        self.alive = False
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            if conn is not None:
                conn.close()
        self._listener.close()
        for log in self._logs:
            log.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


def huge_page_heap(tunables: Optional[str]) -> str:
    """GLIBC_TUNABLES with the heap on transparent huge pages (glibc >= 2.35; older ones ignore it).

    On the 2-core VMs the suite runs on, touching fresh memory costs 0.3-8 s per GiB in the kernel (page faults
    that the hypervisor serves; about 0.1 s on bare metal), and `clear_page` under malloc was 40% of the CPU time of
    a run of test_collectives.py. Its ranks on huge pages: 55-61 s -> 39-49 s (runs vary by 10 s here). Only the
    pools' ranks: jobs that allocate and free many blocks of under 2 MB (the benchmarks) ran slower with it."""
    if tunables and "hugetlb" in tunables:
        return tunables
    return ":".join(filter(None, [tunables, "glibc.malloc.hugetlb=1"]))


def _log_dir() -> str:
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "hpdl-test-pools")
    os.makedirs(path, exist_ok=True)
    return path
