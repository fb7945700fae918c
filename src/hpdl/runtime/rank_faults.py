"""Ranks that die of a fatal signal under MPICH's forking launcher: said, with where, and never exit code 0.

`mpiexec.gforker` prints "signaled with Bus error" for a rank that a signal
killed and then exits 0, so `hpdl launch` reported success for a job whose
ranks had all died (seen with a full /dev/shm: SIGBUS in both ranks, exit
code 0). `hpdl launch` therefore hands every rank a pipe of its own; the rank
points Python's faulthandler at it (`watch`, called by
`hpdl.runtime.run_rank`), which writes the signal's name and every thread's
traceback there as the process dies; the launcher reads the pipes
(`RankFaults`) and, once the job has ended, prints what came with a hint and
makes the exit code 128 + the signal's number, as a shell reports it.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from typing import IO, MutableMapping, Optional

__all__ = ["FAULT_SIGNALS", "RANK_FAULT_FDS", "RankFaults", "watch"]

RANK_FAULT_FDS = "HPDL_RANK_FAULT_FDS"
"""'fd0;fd1;...': one pipe's write end per rank (PMI_RANK picks)."""

_SIGNALS: dict[str, int] = {
    "Segmentation fault": signal.SIGSEGV,
    "Bus error": signal.SIGBUS,
    "Aborted": signal.SIGABRT,
    "Floating-point exception": signal.SIGFPE,
    "Illegal instruction": signal.SIGILL,
}
"""faulthandler's names of the signals it reports."""
FAULT_SIGNALS = frozenset(_SIGNALS.values())

_HINTS: dict[int, str] = {
    int(signal.SIGBUS): "a bus error in an MPI job is most often shared memory running out: /dev/shm is full (64 MB in "
    "a default container: docker run --shm-size=2g or --ipc=host gives more)",
}

_WATCHING: list[IO[str]] = []
"""The rank's end of its pipe, kept open for faulthandler."""


class RankFaults:
    """The launcher's side: a pipe per rank, read until the job has ended."""

    def __init__(self, nprocs: int):
        self.texts = [bytearray() for _ in range(nprocs)]
        self._threads = []
        ends = []
        for rank in range(nprocs):
            read, write = os.pipe()
            ends.append(write)
            thread = threading.Thread(target=self._read, args=(read, self.texts[rank]), daemon=True)
            thread.start()
            self._threads.append(thread)
        self.fds = tuple(ends)
        """Write ends to hand the ranks (the launcher closes its copies once they have started)."""
        self.value = ";".join(map(str, ends))

    @staticmethod
    def _read(fd: int, into: bytearray) -> None:
        with os.fdopen(fd, "rb") as source:
            while chunk := source.read1(65536):
                into += chunk

    def settle(self, code: int, name: str = "hpdl launch", grace: float = 5.0) -> int:
        """The job's exit code once what the ranks reported has been said: 128 + the signal where a rank died of one
        (unless `code` already says a signal), else `code`."""
        for thread in self._threads:
            thread.join(timeout=grace)
        died = [(rank, text.decode(errors="replace")) for rank, text in enumerate(self.texts) if text.strip()]
        kinds = [_signal_of(text) for _, text in died]
        for (rank, text), kind in zip(died, kinds):
            what = signal.Signals(kind).name if kind is not None else "a fatal error"
            print(f"{name}: rank {rank} died of {what}:\n{text.rstrip()}", file=sys.stderr, flush=True)
            if kind in _HINTS:
                print(f"{name}: {_HINTS[kind]}", file=sys.stderr, flush=True)
        # The others' nonzero exit is most often the launcher tearing the job down (seen under load: a rank still
        # starting was interrupted, exit 1, and that code hid the signal).
        if died and code < 128:
            return 128 + (kinds[0] if kinds[0] is not None else int(signal.SIGABRT))
        return code


def _signal_of(text: str) -> Optional[int]:
    for label, number in _SIGNALS.items():
        if label in text:
            return int(number)
    return None


def watch(env: MutableMapping[str, str] = os.environ) -> None:
    """In a rank: report a fatal signal (with every thread's traceback) on the pipe `hpdl launch` handed over."""
    value = env.pop(RANK_FAULT_FDS, "")
    if not value:
        return
    fds = [int(fd) for fd in value.split(";")]
    mine = fds[int(env.get("PMI_RANK", "0"))] if len(fds) > 1 else fds[0]
    for fd in set(fds) - {mine}:
        os.close(fd)
    sink = os.fdopen(mine, "w")
    _WATCHING.append(sink)
    faulthandler.enable(file=sink, all_threads=True)
    os.register_at_fork(after_in_child=_forget)  # a forked child (a DataLoader worker) is not the rank


def _forget() -> None:
    if _WATCHING:
        faulthandler.disable()
        _WATCHING.pop().close()
