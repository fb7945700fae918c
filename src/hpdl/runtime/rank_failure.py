"""How the ranks of an `hpdl launch` job report a failure: one traceback, then one line per other rank.

Left to themselves, the ranks of a failing job all print: every rank that
raises shows its whole traceback (interleaved line by line with the
others'), each starting with the launcher's own frames; each MPI_Abort adds
MPICH's `Abort(1) on node ...` line; a rank interrupted during interpreter
shutdown adds `Exception ignored in: <module 'threading'>`. Under `hpdl
launch` the ranks share a job folder (HPDL_JOB_DIR, made and removed by the
launcher) instead:

- the first rank to fail takes the folder's `first` record (an exclusive
  create, so exactly one rank wins), prints its error on one line, then its
  traceback from the user's first frame on, in one write, and exits;
- a rank that fails after it prints one line, its error;
- a rank the launcher stops (SIGINT from MPICH's forking launcher, SIGTERM
  from `hpdl launch --backend torch`) prints one line: where it was, and
  which rank failed first.

Every exit here is `os._exit`: the job is over, so nothing waits on other
ranks at exit and no interpreter shutdown can be interrupted. The launcher
(not MPI_Abort) stops the rest of the job.
"""

from __future__ import annotations

import os
import signal
import sys
import sysconfig
import threading
import traceback
from types import FrameType, TracebackType
from typing import Any, Optional

__all__ = [
    "JOB_DIR",
    "first_failure",
    "guard_stops",
    "mark_interrupted",
    "report_exit",
    "report_failure",
    "report_interrupt",
    "supervised",
]

JOB_DIR = "HPDL_JOB_DIR"
"""The folder the ranks of one `hpdl launch` job share for their failure records."""

_FIRST = "first"
_INTERRUPTED = "interrupted"
_NOT_USERS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # hpdl
    *{sysconfig.get_path(kind) for kind in ("stdlib", "platstdlib", "purelib", "platlib")},  # Python, packages
    "<frozen",
)
"""Where frames of code other than the user's live."""
_interrupted = False
"""A KeyboardInterrupt was raised here for the launcher's Ctrl-C: a second SIGINT of the same stop is ignored (it
would interrupt run_rank's one-line report and end in hpdl's excepthook)."""
_failing = False
"""This rank is writing its own report: a stop signal now must not cut it short."""


def supervised() -> bool:
    """Whether a launcher that stops the whole job when one rank exits watches this rank (`hpdl launch`)."""
    return bool(os.environ.get(JOB_DIR))


def _rank() -> str:
    for name in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(name, "").isdigit():
            return os.environ[name]
    return "?"


def _claim_first(summary: str) -> bool:
    """Record `summary` as the job's first failure, unless another rank's is there already."""
    try:
        fd = os.open(os.path.join(os.environ[JOB_DIR], _FIRST), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    except OSError:  # the folder is gone (the launcher ended): say everything
        return True
    with os.fdopen(fd, "w") as record:
        record.write(f"rank {_rank()}: {summary}")
    return True


def first_failure(job_dir: Optional[str] = None) -> Optional[str]:
    """'rank 0: ValueError: ...' of the job's first failure, or None while no rank has failed."""
    folder = job_dir or os.environ.get(JOB_DIR, "")
    try:
        with open(os.path.join(folder, _FIRST)) as record:
            return record.read() or None
    except OSError:
        return None


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _user_frames(tb: Optional[TracebackType]) -> Optional[TracebackType]:
    """`tb` without the frames above the user's code: `python -m hpdl.runtime.run_rank` and runpy's."""
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if not (name.endswith(os.path.join("runtime", "run_rank.py")) or "runpy" in name):
            break
        tb = tb.tb_next
    return tb


def _reporting() -> None:
    """This rank says why it ends: a stop signal now (the launcher's, arriving while it writes) is ignored."""
    global _failing
    _failing = True
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _write(text: str) -> None:
    """`text` to stderr in one write: the lines of one rank never interleave with another's."""
    sys.stdout.flush()
    sys.stderr.flush()
    data = text.encode(errors="replace")
    while data:
        data = data[os.write(2, data) :]


def _leave(code: int) -> None:
    if "hpdl.runtime.world" in sys.modules:
        from hpdl.runtime.world import abandon

        abandon()
    os._exit(code)


def report_failure(error: BaseException) -> None:
    """This rank raised `error`: the whole traceback if it failed first, else one line; then exit 1."""
    _reporting()
    summary = _one_line(error)
    if _claim_first(summary):
        tb = _user_frames(error.__traceback__)
        text = "".join(traceback.format_exception(type(error), error, tb))
        _write(f"hpdl: rank {_rank()} failed: {summary}\n{text}")
    elif _is_comm_error(error):  # what the first failure did to this rank's collective: not news
        _write(f"hpdl: rank {_rank()} stopped {_where(_innermost(error))}: {first_failure()}\n")
    else:
        _write(f"hpdl: rank {_rank()} failed too: {summary}\n")
    _leave(1)


def _is_comm_error(error: BaseException) -> bool:
    """An error of hpdl's communication, or torch.distributed's: what a peer's end does to a collective."""
    errors, dist = sys.modules.get("hpdl.errors"), sys.modules.get("torch.distributed")
    kinds = (errors.CommError,) if errors is not None else ()
    kinds += (dist.DistError,) if dist is not None and hasattr(dist, "DistError") else ()
    return isinstance(error, kinds)


def _innermost(error: BaseException) -> Optional[FrameType]:
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame if tb is not None else None


def report_exit(code: int, summary: str = "") -> None:
    """This rank's script called `sys.exit(code)` (not 0), or `summary` says why it ends: one line, then exit with
    that code."""
    _reporting()
    summary = summary or f"exited with code {code}"
    first = _claim_first(summary)
    _write(f"hpdl: rank {_rank()} {summary}{'' if first else ' (after another rank failed)'}\n")
    _leave(code)


def report_interrupt(interrupt: BaseException) -> None:
    """Ctrl-C reached this rank (through the launcher): where it was, in one line; then exit 130."""
    _reporting()
    _write(f"hpdl: rank {_rank()} interrupted {_where(_innermost(interrupt))}\n")
    _leave(130)


def _where(frame: Optional[FrameType]) -> str:
    """'at script.py:12 in step': the innermost frame of the user's own code, else the innermost."""
    if frame is None:
        return "before it ran"
    stack = traceback.StackSummary.extract(traceback.walk_stack(frame), lookup_lines=False)  # innermost first
    own = [f for f in stack if not f.filename.startswith(_NOT_USERS)]
    outside = [f for f in stack if not f.filename.startswith(_NOT_USERS[0])]
    if not (own or outside):
        return "as it started"
    chosen = (own or outside)[0]
    return f"at {chosen.filename}:{chosen.lineno} in {chosen.name}"


def _stopped(signum: int, frame: Optional[FrameType]) -> Any:
    """The launcher stops this rank: one line naming the rank that failed first; Ctrl-C stays an interrupt."""
    if _failing:
        return None  # this rank is failing itself: its own report comes
    first = first_failure()
    if first is not None:
        _reporting()
        _write(f"hpdl: rank {_rank()} stopped {_where(frame)}: {first}\n")
        _leave(1)
    if signum == signal.SIGINT and os.path.exists(os.path.join(os.environ[JOB_DIR], _INTERRUPTED)):
        global _interrupted
        if _interrupted:
            return None  # the same Ctrl-C again: the launcher's and the MPI launcher's SIGINT both reach a rank
        _interrupted = True
        raise KeyboardInterrupt  # Ctrl-C: the script may handle it; else run_rank says where it was
    _reporting()
    _write(f"hpdl: rank {_rank()} stopped by the launcher {_where(frame)}: another rank ended without a report\n")
    _leave(1)  # not 128 + signum: the job's code is the silent rank's (gforker passes on the largest), not an interrupt


def mark_interrupted(job_dir: str) -> None:
    """The launcher: the SIGINT the ranks are about to get is the user's Ctrl-C, not a stop after a failure."""
    try:
        open(os.path.join(job_dir, _INTERRUPTED), "w").close()
    except OSError:
        pass


def guard_stops() -> None:
    """Answer the launcher's SIGINT and SIGTERM with one line (see `_stopped`), in the main thread."""
    signal.signal(signal.SIGINT, _stopped)
    signal.signal(signal.SIGTERM, _stopped)
