"""The shared-memory thresholds measured on this machine (`hpdl tune`): the file, and its reading at hpdl.init.

Where the node's shared-memory collectives overtake plain MPI is a property of the host (memory bandwidth, caches,
the MPI library, the load), not of the code: on one VM type, runs a day apart put allreduce's crossover 2x apart.
Thresholds fixed in code cannot promise "never slower than MPI"; `hpdl tune` times both paths per operation and
size on this node and writes, per number of ranks per node, the smallest size from which shared memory won there
and at every larger size it measured. Every rank must choose the same path for a call, so rank 0 reads the file
and every rank takes its answer (`agree`); `HPDL_SHM_MIN_<OP>` still overrides one operation.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import tempfile
import time
from typing import Any, Optional, Sequence

import numpy as np

import hpdl.settings as settings
from hpdl.comm import shm
from hpdl.comm.work import wait_for
from hpdl.errors import TuneFileError

__all__ = ["ENV", "FORMAT", "WIN", "Tuning", "agree", "choose", "default_path", "new", "path", "read",
           "thresholds_for", "write"]  # fmt: skip

ENV = "HPDL_TUNE_FILE"
"""Where the file is (default: $XDG_CACHE_HOME/hpdl/shm-thresholds.json); `off` reads none."""
FORMAT = 1
WIN = 0.95
"""A path wins at a size when its median time is at most this fraction of plain MPI's: a tie stays with MPI."""
Thresholds = dict[str, tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class Tuning:
    """A tuning file's contents: thresholds per ranks-per-node, for one MPI library."""

    path: str
    mpi: str
    host: str
    written: str
    per_node: dict[int, Thresholds]
    measured: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Per ranks-per-node, the timings behind the thresholds (kept in the file, unused at run time)."""


def default_path() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "hpdl", "shm-thresholds.json")


def path() -> Optional[str]:
    """The tuning file hpdl reads (HPDL_TUNE_FILE, else the default), or None when switched off."""
    chosen = settings.text(ENV) or ""
    if chosen.lower() in ("0", "off", "no", "false", "none"):
        return None
    return chosen or default_path()


def _fail(where: str, what: str) -> TuneFileError:
    return TuneFileError(
        f"{where}: {what}. Write it again with `hpdl tune`, or delete it (or set {ENV}=off) to use the built-in "
        "shared-memory thresholds"
    )


def read(where: str) -> Optional[Tuning]:
    """The file at `where`, None when there is none; TuneFileError when it cannot be used as written."""
    try:
        with open(where) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise _fail(where, f"unreadable ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise _fail(where, f"not an hpdl tuning file of format {FORMAT}")
    try:
        per_node = {int(local): _thresholds(entry) for local, entry in data["ranks_per_node"].items()}
        return Tuning(where, str(data["mpi"]), str(data["host"]), str(data["written"]), per_node,
                      dict(data.get("measured", {})))  # fmt: skip
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise _fail(where, f"malformed ({type(exc).__name__}: {exc})") from None


def _thresholds(entry: dict[str, Any]) -> Thresholds:
    out = {}
    for op in shm.DEFAULT_THRESHOLDS:
        zero_copy, ordinary = (shm.NEVER if n is None else int(n) for n in entry[op])
        if not 0 <= zero_copy <= ordinary <= shm.NEVER:
            raise ValueError(f"{op}: want 0 <= zero-copy <= ordinary <= {shm.NEVER}, got {zero_copy}, {ordinary}")
        out[op] = (zero_copy, ordinary)
    return out


def write(where: str, tuning: Tuning) -> None:
    """Write `tuning`, keeping the other ranks-per-node entries of a file for the same MPI library (atomically)."""
    per_node, measured = dict(tuning.per_node), dict(tuning.measured)
    try:
        old = read(where)
    except TuneFileError:
        old = None  # being replaced
    if old is not None and old.mpi == tuning.mpi:
        per_node = {**old.per_node, **per_node}
        # per operation: a run of some operations (`--ops`) keeps the others' timings of that entry
        measured = {
            local: {**old.measured.get(local, {}), **ops} if isinstance(old.measured.get(local), dict) else ops
            for local, ops in measured.items()
        }
        measured = {**old.measured, **measured}
    data = {
        "format": FORMAT,
        "mpi": tuning.mpi,
        "host": tuning.host,
        "written": tuning.written,
        "ranks_per_node": {str(k): _written(t) for k, t in sorted(per_node.items())},
        "measured": measured,
    }
    os.makedirs(os.path.dirname(os.path.abspath(where)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(where)), prefix=".shm-thresholds.")
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=1)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o644 & ~umask)  # (mkstemp makes it private: others who read the same file could not)
    os.replace(tmp, where)


def _written(thresholds: Thresholds) -> dict[str, list[Optional[int]]]:
    """null for never: the file is read by people too."""
    return {op: [None if n >= shm.NEVER else n for n in pair] for op, pair in thresholds.items()}


def new(mpi: str, local_size: int, thresholds: Thresholds, measured: Any) -> Tuning:
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return Tuning("", mpi, socket.gethostname(), when, {local_size: thresholds}, {str(local_size): measured})


def choose(ratios: Sequence[tuple[int, float]]) -> int:
    """The smallest measured size from which the shared-memory path won (time ratio to MPI <= WIN) at that size
    and at every larger one; shm.NEVER when it did not win at the largest."""
    threshold = shm.NEVER
    for nbytes, ratio in sorted(ratios, reverse=True):
        if not ratio <= WIN:  # NaN (not measured) loses too
            break
        threshold = nbytes
    return threshold


def thresholds_for(tuning: Optional[Tuning], local_size: int, mpi: str) -> tuple[Thresholds, str]:
    """The thresholds a communicator with `local_size` ranks per node uses, and where they come from."""
    built_in = dict(shm.DEFAULT_THRESHOLDS)
    if tuning is None:
        return built_in, "built-in"
    if local_size == 0:
        return built_in, "built-in (nodes hold different numbers of ranks)"
    if tuning.mpi != mpi:
        return built_in, f"built-in ({tuning.path} was measured with {tuning.mpi}; this job runs {mpi})"
    if local_size not in tuning.per_node:
        have = ", ".join(map(str, sorted(tuning.per_node))) or "none"
        return built_in, (
            f"built-in ({tuning.path} has {have} ranks per node, not {local_size}: `hpdl tune -n {local_size}`)"
        )
    return dict(tuning.per_node[local_size]), f"tuned ({tuning.path}, {tuning.host}, {tuning.written})"


def agree(mpi_comm: Any, timeout: float, where: Optional[str] = None) -> Optional[Tuning]:
    """Rank 0's reading of the tuning file, on every rank of `mpi_comm` (its error, too, raised everywhere).

    `where` defaults to `path()`; every wait is bounded by `timeout`."""
    from mpi4py import MPI

    payload = b""
    if mpi_comm.Get_rank() == 0:
        where = path() if where is None else where
        try:
            found = read(where) if where else None
            shared = dataclasses.asdict(dataclasses.replace(found, measured={})) if found else None
            payload = json.dumps({"tuning": shared}).encode()
        except Exception as exc:  # raised on every rank, not on rank 0 alone
            text = str(exc) if isinstance(exc, TuneFileError) else f"{where}: {type(exc).__name__}: {exc}"
            payload = json.dumps({"error": text}).encode()
    length = np.array([len(payload)], dtype=np.int64)
    deadline = time.perf_counter() + timeout
    _bounded(mpi_comm.Ibcast([length, MPI.INT64_T], root=0), deadline, timeout)
    data = bytearray(payload) if mpi_comm.Get_rank() == 0 else bytearray(int(length[0]))
    _bounded(mpi_comm.Ibcast([data, MPI.BYTE], root=0), deadline, timeout)
    answer = json.loads(bytes(data))
    if "error" in answer:
        raise TuneFileError(answer["error"])
    found = answer["tuning"]
    if found is None:
        return None
    per_node = {int(k): {op: (int(a), int(b)) for op, (a, b) in v.items()} for k, v in found["per_node"].items()}
    return Tuning(found["path"], found["mpi"], found["host"], found["written"], per_node, found["measured"])


def uniform_node_size(mpi_comm: Any, local_size: int, timeout: float) -> int:
    """`local_size` when every rank of `mpi_comm` has that many ranks on its node, else 0 (bounded): ranks that
    looked up different entries would choose different paths for one call."""
    from mpi4py import MPI

    extremes = np.array([local_size, -local_size], dtype=np.int64)
    _bounded(mpi_comm.Iallreduce(MPI.IN_PLACE, [extremes, MPI.INT64_T], op=MPI.MAX), time.perf_counter() + timeout,
             timeout)  # fmt: skip
    return local_size if int(extremes[0]) == -int(extremes[1]) else 0


def _bounded(request: Any, deadline: float, timeout: float) -> None:
    wait_for(request, deadline, timeout, "hpdl.init: sending rank 0's shared-memory thresholds to every rank", "tuning")
