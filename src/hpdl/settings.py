"""Every `HPDL_*` environment variable hpdl reads: its type, default, one-line doc and the floor that reads it.

One table, so that each read is typed and checked the same way (a bad value is an error that names the variable
and says what it must be), `hpdl info --env` and docs/settings.md list every setting, `hpdl launch` checks them
all before any rank starts, and a misspelt name (`HPDL_TIMOUT`) is a warning instead of silently nothing. A leaf
module (standard library only): any floor of hpdl may read through it. `python -m hpdl.settings --markdown`
writes docs/settings.md.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, TypeVar, Union

__all__ = [
    "SETTINGS",
    "Setting",
    "flag",
    "number",
    "text",
    "read",
    "lookup",
    "problems",
    "unknown",
    "warn_unknown",
    "table",
    "markdown",
]

N = TypeVar("N", int, float)

FALSE = ("", "0", "false", "no", "off")
"""What a yes/no setting takes as no (any case; surrounding blanks ignored). Anything else is yes."""

TEST_PREFIX = "HPDL_TEST_"
"""Names a test suite may use to label its own processes (a rank pool's purpose): never warned about."""


@dataclass(frozen=True)
class Setting:
    """One environment variable. `default` is what an unset (or empty) variable means, as the reader takes it;
    `shown` says it in words where it depends on the machine or the launcher."""

    name: str
    kind: str  # "flag", "int", "float", "text", "choice" or "launcher" (set by `hpdl launch` for its ranks)
    default: Any
    doc: str
    floor: str  # the floor (top-level package) of its reader: comm, runtime, interop, dask, train, plan, cli
    reader: str  # the module that reads it
    what: str = ""  # a number's unit, as the error says it: "a number of seconds"
    minimum: Optional[float] = None
    maximum: Optional[float] = None
    allow_zero: bool = False
    choices: tuple[str, ...] = ()
    shown: str = ""

    @property
    def default_text(self) -> str:
        if self.shown:
            return self.shown
        if self.kind == "flag":
            return "on" if self.default else "off"
        if isinstance(self.default, float):
            return f"{self.default:g}"
        return "unset" if self.default is None else str(self.default)


def _n(name: str, kind: str, default: Any, what: str, doc: str, floor: str, reader: str, **more: Any) -> Setting:
    return Setting(name, kind, default, doc, floor, reader, what=what, **more)


_SHM_OPS = ("ALLREDUCE", "REDUCE_SCATTER", "ALLGATHER", "BROADCAST")

_ALL: tuple[Setting, ...] = (
    # comm: the communicators
    _n("HPDL_TIMEOUT", "float", 300.0, "a number of seconds", "Seconds any single wait may take.", "comm",
       "hpdl.comm.base"),
    Setting("HPDL_DEBUG", "flag", False, "Compare every rank's collective (a fingerprint) before it runs.", "comm",
            "hpdl.comm.base"),
    _n("HPDL_CHECK_EVERY", "int", None, "a number of collectives (0: off)",
       "Collectives between two agreement checks of the ranks' calls.", "comm", "hpdl.comm.agreement",
       allow_zero=True, shown="16 on mpi, 0 on torch"),
    _n("HPDL_FUSION_MB", "float", 64.0, "a number of megabytes",
       "Size of `allreduce_coalesced`'s flat buffers, in MiB.", "comm", "hpdl.comm.fusion"),
    Setting("HPDL_COMPILED", "flag", True, "0: call MPI through mpi4py and copy through torch even where the "
            "compiled modules were built.", "comm", "hpdl.comm.mpi_calls"),
    Setting("HPDL_MPI_CUDA_AWARE", "flag", None, "0: stage GPU tensors through the host; 1: pass device pointers "
            "to MPI.", "comm", "hpdl.comm.mpi_library", shown="unset: detected"),
    _n("HPDL_RANKS_PER_NODE", "int", 0, "a positive int", "Cut each node into virtual nodes of this many ranks "
       "(tests multi-node paths on one machine).", "comm", "hpdl.comm.mpi_library", shown="unset"),
    Setting("HPDL_COUNTED_REDUCE_SCATTER", "text", None, "FROM:TO bytes of reduce_scatter input that call "
            "MPI_Ireduce_scatter instead of its _block twin; 0: none.", "comm", "hpdl.comm.mpi_calls",
            shown="524288:2097152 under MPICH, else none"),
    _n("HPDL_PAIR_BYTES", "int", None, "bytes (0: never)", "Below this many bytes, collectives of two ranks (and "
       "allreduce of 4, 8, ...) travel as messages.", "comm", "hpdl.comm.pairs", allow_zero=True,
       shown="measured per op and rank count (docs/comm.md)"),
    Setting("HPDL_PROBE_FIRST", "flag", None, "1: the mpi backend's receives wait for a matched probe; 0: "
            "receive at once.", "comm", "hpdl.comm.pairs", shown="on outside MPICH, MVAPICH and Intel MPI"),
    Setting("HPDL_SHM", "flag", True, "0: no shared-memory collectives on the mpi backend.", "comm",
            "hpdl.comm.shm"),
    _n("HPDL_SHM_MB", "float", 32.0, "a number of megabytes", "Shared-memory staging per rank, in MiB.", "comm",
       "hpdl.comm.shm"),
    _n("HPDL_SHM_PIECE_MB", "float", 4.0, "a number of megabytes", "Largest piece a shared-memory collective "
       "copies in, reduces and copies out at a time, in MiB.", "comm", "hpdl.comm.shm"),
    *(
        _n(f"HPDL_SHM_MIN_{op}", "int", None, "a number of bytes", f"Smallest {op.lower()} (bytes) that takes the "
           "shared-memory path, for both kinds of tensor.", "comm", "hpdl.comm.shm", allow_zero=True,
           shown="measured (`hpdl tune`) or built in")
        for op in _SHM_OPS
    ),
    _n("HPDL_SHM_MIN_ALLREDUCE_COALESCED", "int", 65536, "a number of bytes", "Smallest fusion bucket reduced "
       "straight from its tensors through shared memory.", "comm", "hpdl.comm.shm", allow_zero=True),
    _n("HPDL_SHM_AVAILABLE_BYTES", "int", None, "a number of bytes", "Pretend /dev/shm has this many bytes free "
       "(for tests).", "comm", "hpdl.comm.shm", allow_zero=True, shown="unset: measured"),
    Setting("HPDL_TUNE_FILE", "text", None, "The file of `hpdl tune`'s thresholds; off: the built-in ones.", "comm",
            "hpdl.comm.tuning", shown="$XDG_CACHE_HOME/hpdl/shm-thresholds.json"),
    # runtime: launchers, rendezvous, the world
    Setting("HPDL_BACKEND", "choice", None, "The backend `hpdl.init()` (\"auto\") starts; `hpdl launch` sets it.",
            "runtime", "hpdl.runtime.environment", choices=("mpi", "torch", "self"),
            shown="detected from the launcher"),
    Setting("HPDL_BIND_ADDR", "text", None, "The address rank 0's rendezvous store (and Dask's tcp:// listeners) "
            "bind and the other ranks reach.", "runtime", "hpdl.runtime.addresses",
            shown="MASTER_ADDR's; under MPI 127.0.0.1 or an address every host reaches"),
    Setting("HPDL_TORCH_ENGINE", "text", None, "What the torch backend passes to init_process_group (gloo, nccl, "
            "cpu:gloo,cuda:nccl).", "runtime", "hpdl.runtime.world", shown="cpu:gloo,cuda:nccl with CUDA, else gloo"),
    _n("HPDL_RESTART_COUNT", "launcher", 0, "a number of restarts", "How many times `hpdl launch "
       "--max-restarts` started this job again.", "runtime", "hpdl.runtime.environment", allow_zero=True),
    Setting("HPDL_STORE_FD", "launcher", None, "The rendezvous store's listening socket the launcher hands rank 0.",
            "runtime", "hpdl.runtime.store"),
    Setting("HPDL_JOB_DIR", "launcher", None, "The job folder the ranks of `hpdl launch` report failures in.",
            "runtime", "hpdl.runtime.rank_failure"),
    Setting("HPDL_RANK_OUTPUT_FDS", "launcher", None, "The pipes a rank's output goes to the launcher through.",
            "runtime", "hpdl.runtime.rank_output"),
    Setting("HPDL_RANK_FAULT_FDS", "launcher", None, "The pipe a rank's fault report goes to the launcher "
            "through.", "runtime", "hpdl.runtime.rank_faults"),
    # interop: the "hpdl" torch.distributed backend
    _n("HPDL_TORCH_SPIN_US", "float", 100.0, "a number of microseconds", "How long the backend's progress thread "
       "tests a new operation without pausing.", "interop", "hpdl.interop.torch_backend.progress", allow_zero=True),
    _n("HPDL_TORCH_POLL_US", "float", 50.0, "a number of microseconds", "The progress thread's pause between "
       "tests after the spin.", "interop", "hpdl.interop.torch_backend.progress", allow_zero=True),
    _n("HPDL_TORCH_QUICK_US", "float", 50.0, "a number of microseconds", "How long a lone collective up to 64 KiB "
       "is tested in a tight loop at once.", "interop", "hpdl.interop.torch_backend.progress", allow_zero=True),
    _n("HPDL_TORCH_POOL_MB", "float", 1024.0, "a number of MiB", "At most this much of freed receive buffers "
       "waits for reuse; 0: no pool.", "interop", "hpdl.interop.torch_backend.buffer_pool", allow_zero=True),
    # dask: the mpi:// transport
    _n("HPDL_DASK_MPI_CHUNK", "int", 2**31 - 1, "a number of bytes", "Bytes per MPI message of a large frame.",
       "dask", "hpdl.dask.frames", maximum=2**31 - 1),
    _n("HPDL_DASK_MPI_INLINE", "int", 4194304, "a number of bytes", "Messages with at most this many frame bytes "
       "travel as one MPI message.", "dask", "hpdl.dask.frames", allow_zero=True),
    _n("HPDL_DASK_POLL_MAX_US", "float", 1000.0, "a number of microseconds", "Longest pause of the transport's "
       "idle poll.", "dask", "hpdl.dask.progress", minimum=10, maximum=1_000_000),
    _n("HPDL_MALLOC_KEEP", "int", 268435456, "a number of bytes (0: leave malloc alone)", "Freed memory the "
       "mpi:// transport's and the planner's processes keep for reuse instead of returning it to the system "
       "(glibc's trim threshold).", "runtime", "hpdl.runtime.memory", allow_zero=True),
    # train, plan, cli
    Setting("HPDL_TIMELINE", "text", None, "The Chrome-trace file `Trainer.fit` writes at its end.", "train",
            "hpdl.train.trainer"),
    Setting("HPDL_PLAN_DEBUG", "flag", False, "Add the traceback to a plan's failure in `hpdl plan`'s report.",
            "plan", "hpdl.plan.validate"),
    Setting("HPDL_CLUSTER", "text", "hpdl", "The simulated cluster `hpdl-cluster-rsh` runs commands in.", "cli",
            "hpdl.cli.cluster"),
)  # fmt: skip

SETTINGS: dict[str, Setting] = {s.name: s for s in _ALL}
"""Every setting by name, in the order of the table (floor by floor)."""


def lookup(name: str) -> Setting:
    """The registered setting `name`; a LookupError that says where to add it otherwise (a programming error)."""
    try:
        return SETTINGS[name]
    except KeyError:
        import difflib

        near = difflib.get_close_matches(name, SETTINGS, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise LookupError(
            f"{name} is not a registered hpdl setting{hint}: add it to hpdl.settings (name, type, default, doc) "
            "and regenerate docs/settings.md"
        ) from None


def _raw(name: str, env: Optional[Mapping[str, str]]) -> Optional[str]:
    lookup(name)
    return (os.environ if env is None else env).get(name)


def flag(name: str, default: Optional[bool] = None, env: Optional[Mapping[str, str]] = None) -> bool:
    """A yes/no setting: 0, false, no, off (any case) or empty mean no, anything else yes; `default` (else the
    table's) when unset."""
    value = _raw(name, env)
    if value is None:
        return bool(lookup(name).default if default is None else default)
    return value.strip().lower() not in FALSE


def number(
    name: str,
    default: Optional[N] = None,
    kind: Optional[Callable[[str], N]] = None,
    what: str = "",
    *,
    allow_zero: Optional[bool] = None,
    env: Optional[Mapping[str, str]] = None,
) -> N:
    """The number in `name`, checked against the table's bounds (positive, or non-negative where zero means
    something); `default` (else the table's) when unset or empty. The error names the variable and what it takes."""
    entry = lookup(name)
    parse: Callable[[str], Any] = kind or (int if entry.kind in ("int", "launcher") else float)
    chosen = entry.default if default is None else default
    text = (_raw(name, env) or "").strip()
    if not text:
        return chosen  # type: ignore[no-any-return]
    what = what or entry.what or ("an integer" if parse is int else "a number")
    try:
        value = parse(text)
        if value != value or value in (float("inf"), -float("inf")):
            raise ValueError(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} must be {what}") from None
    zero = entry.allow_zero if allow_zero is None else allow_zero
    if value < 0 or (value == 0 and not zero):
        raise ValueError(f"{name}={text!r} must be {'non-negative' if zero else 'positive'}")
    low = -float("inf") if entry.minimum is None else entry.minimum
    high = float("inf") if entry.maximum is None else entry.maximum
    if not low <= value <= high:
        bounds = f"between {_fmt(low)} and {_fmt(high)}" if entry.minimum is not None else f"at most {_fmt(high)}"
        raise ValueError(f"{name}={text!r} must be {bounds} ({what})")
    return value  # type: ignore[no-any-return]


def _fmt(bound: float) -> str:
    return str(int(bound)) if bound == int(bound) else str(bound)


def text(name: str, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A text setting, blanks stripped; None when unset or empty. A choice must be one of its choices."""
    entry = lookup(name)
    value = (_raw(name, env) or "").strip()
    if not value:
        return None if entry.default is None else str(entry.default)
    if entry.choices and value not in entry.choices:
        raise ValueError(f"{name}={value!r}: choose one of {', '.join(entry.choices)}")
    return value


def read(name: str, env: Optional[Mapping[str, str]] = None) -> Union[bool, int, float, str, None]:
    """The setting as its kind reads it, with the table's default."""
    kind = lookup(name).kind
    if kind == "flag":
        return flag(name, env=env) if (_raw(name, env) is not None or lookup(name).default is not None) else None
    if kind in ("int", "float"):
        return number(name, env=env)
    return text(name, env=env)


def problems(env: Optional[Mapping[str, str]] = None) -> list[str]:
    """Every set variable whose value its reader would refuse, each as the reader's error (what `hpdl launch`
    says once instead of a traceback on every rank)."""
    env = os.environ if env is None else env
    found = []
    for entry in _ALL:
        if entry.name not in env or entry.kind not in ("int", "float", "choice"):
            continue
        try:
            read(entry.name, env)
        except ValueError as error:
            found.append(str(error))
    return found


def unknown(env: Optional[Mapping[str, str]] = None) -> list[tuple[str, Optional[str]]]:
    """The `HPDL_*` variables in `env` that are no setting, each with the nearest known name (or None)."""
    import difflib

    env = os.environ if env is None else env
    names = sorted(k for k in env if k.startswith("HPDL_") and k not in SETTINGS and not k.startswith(TEST_PREFIX))
    return [(k, next(iter(difflib.get_close_matches(k, SETTINGS, n=1, cutoff=0.7)), None)) for k in names]


_warned: set[str] = set()


def warn_unknown(env: Optional[Mapping[str, str]] = None, say: Optional[Callable[[str], None]] = None) -> list[str]:
    """Warn once per process about each unknown `HPDL_*` variable, with the nearest known name (through `say`
    instead of `warnings` where given): called where a program asks for hpdl (`hpdl.init`,
    `init_process_group("hpdl")`, `hpdl launch`), never at import. The ranks of `hpdl launch` (HPDL_JOB_DIR set)
    stay quiet: the launcher said it once. Returns what was said now."""
    env = os.environ if env is None else env
    if env.get("HPDL_JOB_DIR"):
        return []
    said = []
    for name, near in unknown(env):
        if name in _warned:
            continue
        _warned.add(name)
        hint = f"did you mean {near}? " if near else ""
        message = f"{name} is not an hpdl setting and is ignored ({hint}`hpdl info --env` lists them all)"
        if say is None:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        else:
            say(message)
        said.append(message)
    return said


def table(env: Optional[Mapping[str, str]] = None) -> list[tuple[str, str, str, str]]:
    """(name, value now, default, doc) per setting: what `hpdl info --env` prints."""
    env = os.environ if env is None else env
    return [(s.name, env.get(s.name, "(unset)"), s.default_text, s.doc) for s in _ALL]


_KINDS = {"flag": "yes/no", "int": "integer", "float": "number", "text": "text", "choice": "choice"}


def markdown() -> str:
    """docs/settings.md, from the table (a test checks that the committed file is this)."""
    lines = [
        "# Settings (`HPDL_*` environment variables)",
        "",
        "<!-- Generated from src/hpdl/settings.py by `hpdl info --env --markdown > docs/settings.md`;",
        "     edit the table there, not this file (tests/test_settings.py checks that they agree). -->",
        "",
        "Every environment variable hpdl reads. `hpdl info --env` prints the same table with the values set now;",
        "`hpdl launch` checks every set value before any rank starts, and `hpdl.init` (or",
        '`init_process_group("hpdl")`, or `hpdl launch`) warns about an `HPDL_*` variable that is none of these,',
        "naming the nearest one. A yes/no setting takes `0`, `false`, `no`, `off` (any case) or an empty value",
        "as no and anything else as yes; a number must be positive unless its unit says that 0 means something.",
        "",
    ]
    for floor in dict.fromkeys(s.floor for s in _ALL):
        lines += [f"## {floor}", "", "| Name | Takes | Default | What it does | Read by |", "|---|---|---|---|---|"]
        for s in (s for s in _ALL if s.floor == floor):
            kind = "set by `hpdl launch`" if s.kind == "launcher" else s.what or _KINDS[s.kind]
            if s.kind == "choice":
                kind += ": " + ", ".join(f"`{c}`" for c in s.choices)
            doc = s.doc.replace("|", "\\|")
            lines.append(f"| `{s.name}` | {kind} | {s.default_text.replace('|', '/')} | {doc} | `{s.reader}` |")
        lines.append("")
    return "\n".join(lines)
