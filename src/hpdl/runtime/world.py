"""`init()` and `finalize()`: start the chosen backend, and leave every backend cleanly.

A multi-rank job must end as one: an uncaught exception on any rank shows
its traceback once and stops the other ranks (MPI_Abort on the mpi backend;
the launcher stops the rest on torch), and a successful job exits 0 even on
gloo, whose process group must be destroyed after a barrier.
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Optional

import hpdl.settings as settings
from hpdl.comm.base import Communicator, default_debug, default_timeout
from hpdl.errors import BackendUnavailableError, CommError, CommTimeoutError, NotInitializedError
from hpdl.runtime.environment import BACKENDS, Launch, detect, is_loopback, loopback_interface
from hpdl.runtime.store import listen_for_store, open_store_over_mpi, rendezvous_store

__all__ = ["broken", "init", "finalize", "world", "is_initialized"]

_worlds: dict[str, Communicator] = {}
_current: Optional[Communicator] = None
_atexit_registered = False


def init(backend: str = "auto", *, timeout: Optional[float] = None, debug: Optional[bool] = None) -> Communicator:
    """Start (or return the already started) world communicator of `backend`.

    backend: "auto" (from the launcher: see `hpdl.runtime.environment`),
    "mpi", "torch" or "self". timeout: seconds any wait may take (default
    HPDL_TIMEOUT or 300). debug: compare collective fingerprints before each
    call (default HPDL_DEBUG).
    """
    global _current, _atexit_registered
    settings.warn_unknown()  # a misspelt HPDL_* name: said once, here (never at import)
    launch = detect()
    chosen = launch.backend if backend == "auto" else backend
    if chosen not in BACKENDS:
        raise ValueError(f"hpdl.init: unknown backend {backend!r}; choose 'auto', {', '.join(map(repr, BACKENDS))}")
    seconds = default_timeout() if timeout is None else float(timeout)
    if seconds <= 0:
        raise ValueError(f"hpdl.init: timeout={timeout!r} must be a positive number of seconds")
    checking = default_debug() if debug is None else bool(debug)
    if chosen in _worlds:
        _current = _worlds[chosen]
        if timeout is not None:
            _current.timeout = seconds
        if debug is not None:
            _current.debug = checking
        return _current
    if chosen == "mpi":
        comm = _mpi_world(launch, seconds, checking)
    elif chosen == "torch":
        comm = _torch_world(launch, seconds, checking)
    else:
        from hpdl.comm.self_backend import SelfCommunicator

        comm = SelfCommunicator(timeout=seconds, debug=checking)
    _worlds[chosen] = comm
    _current = comm
    if comm.size > 1:
        _install_abort_hook()
    if not _atexit_registered:
        atexit.register(finalize)
        _atexit_registered = True
    return comm


def finalize() -> None:
    """Close every world communicator (barrier first on torch, so gloo exits cleanly). Safe to call twice."""
    global _current
    for comm in reversed(list(_worlds.values())):
        if comm.backend == "torch":
            _close_torch(comm)
        else:
            comm.close()
    _worlds.clear()
    _current = None


def abandon() -> None:
    """This rank is failing: let `finalize` skip every wait on other ranks (they may never come)."""
    for comm in _worlds.values():
        comm._broken = True


def broken() -> Optional[Communicator]:
    """A world communicator that a communication failure broke (a timeout, a lost peer), if any."""
    return next((comm for comm in _worlds.values() if comm._broken), None)


def world() -> Communicator:
    """The communicator from the latest `init()`; NotInitializedError before it or after `finalize()`."""
    if _current is None:
        raise NotInitializedError("hpdl is not initialised: call hpdl.init() first (or again after hpdl.finalize())")
    return _current


def is_initialized() -> bool:
    return _current is not None


def _mpi_library_for(launch: Launch) -> None:
    """Open MPI's launcher with mpi4py about to load MPICH's library (the `mpich` wheel): MPICH would abort the
    process inside MPI_Init ("Runtime environment uses unsupported PMI version PMIx"). Say why and what to do."""
    if launch.launcher != "openmpi" or "mpi4py.MPI" in sys.modules:
        return
    try:
        import importlib.metadata

        importlib.metadata.version("mpich")  # the wheel is installed (a site's MPICH may be built with PMIx)
        from mpi4py import _mpiabi  # (mpi4py >= 4: the library its binary wheel will load; MPI is not started)

        library = str(_mpiabi._get_mpiabi())  # type: ignore[attr-defined]
    except Exception:  # no mpich wheel, an mpi4py built against one MPI, another version: nothing to tell
        return
    if library.startswith("mpich"):
        raise BackendUnavailableError(
            "Open MPI's mpirun started this process, but mpi4py is about to load MPICH's library (the mpich wheel), "
            "which cannot start under it. Point mpi4py at Open MPI's library and forward the variable "
            "(`mpirun -x MPI4PY_LIBMPI ...` with MPI4PY_LIBMPI=/path/to/openmpi/lib/libmpi.so.40), or start the "
            "job with `hpdl launch` or MPICH's mpiexec."
        )


def _mpi_world(launch: Launch, timeout: float, debug: bool) -> Communicator:
    _mpi_library_for(launch)
    from hpdl.comm.mpi_backend import MPI, MpiCommunicator  # (Open MPI's settings: chosen at `import hpdl`)

    comm = MpiCommunicator(MPI.COMM_WORLD, timeout=timeout, debug=debug, read_tuning=True)
    comm.hosts = MPI.COMM_WORLD.allgather(socket.gethostname())
    if launch.size is not None and launch.size != comm.size:
        raise BackendUnavailableError(
            f"the launcher ({launch.launcher}) started {launch.size} ranks but MPI sees {comm.size}: mpi4py is "
            "linked to a different MPI library than the launcher's. Rebuild it against the site MPI "
            "(`env MPICC=$(which mpicc) pip install --no-binary=mpi4py --force-reinstall mpi4py`) and do not "
            "install the `mpich` wheel there, or launch with that MPI's own mpiexec."
        )
    return comm


def _torch_world(launch: Launch, timeout: float, debug: bool) -> Communicator:
    import datetime

    import torch
    import torch.distributed as dist

    from hpdl.comm.torch_backend import TorchCommunicator

    if not dist.is_available():
        raise BackendUnavailableError("this torch build has no torch.distributed; install a standard torch wheel")
    span = datetime.timedelta(seconds=timeout)
    if dist.is_initialized():  # by the script itself: progress reports go through its group's own store
        store = dist.distributed_c10d._get_default_store()
    else:
        engine = settings.text("HPDL_TORCH_ENGINE") or ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
        rank, size, store = _torch_rendezvous(launch, span)
        if is_loopback(store.host):  # every rank is on this machine: gloo's own listeners on loopback too
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        dist.init_process_group(engine, store=store, rank=rank, world_size=size, timeout=span)
        # The process group is the store's only owner, and tears it down in destroy_process_group: a store
        # server of ours, destroyed during interpreter shutdown, can abort the process at exit. A client of
        # it, for progress reports when a wait times out.
        store = dist.TCPStore(store.host, store.port, size, is_master=False, timeout=span)
    comm = TorchCommunicator(None, store, local_rank=0, local_size=1, timeout=timeout, debug=debug)
    hosts = comm.allgather_object(socket.gethostname())
    comm.hosts = hosts
    same_node = [r for r, host in enumerate(hosts) if host == hosts[comm.rank]]
    comm.local_rank, comm.local_size = same_node.index(comm.rank), len(same_node)
    return comm


def _torch_rendezvous(launch: Launch, span: Any) -> tuple[int, int, Any]:
    """Rank, size and the rendezvous store (rank 0 serves it): from torchrun-style variables, or agreed over
    MPI under mpirun/srun."""
    env = os.environ
    if all(env.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
        return rank, size, rendezvous_store(rank, size, env["MASTER_ADDR"], int(env["MASTER_PORT"]), span)
    if launch.launcher in ("none", "torchrun") and launch.size in (None, 1):
        return 0, 1, rendezvous_store(0, 1, "127.0.0.1", listen_for_store("127.0.0.1", 1), span)
    from hpdl.comm.mpi_backend import MPI

    mpi = MPI.COMM_WORLD
    rank, size = mpi.Get_rank(), mpi.Get_size()
    store = open_store_over_mpi(lambda told: mpi.bcast(told, root=0), mpi.allgather, rank, size, span, "hpdl.init")
    return rank, size, store


def _close_torch(comm: Communicator) -> None:
    import torch.distributed as dist

    comm._exit_barrier()  # gloo aborts at exit unless the group is torn down after a barrier
    # Engine handles still held in reference cycles (hooks, closures) must die while their
    # process group is alive: destroyed during interpreter shutdown, they can abort the process.
    gc.collect()
    comm.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def _install_abort_hook() -> None:
    """An uncaught exception on any rank ends the whole job at once, with this rank's traceback shown once."""
    if getattr(sys.excepthook, "_hpdl", False):
        return
    previous = sys.excepthook

    def abort_job(kind: Any, error: BaseException, tb: Any) -> None:
        # torch.distributed's own excepthook (installed by init_process_group, around this one) buffers
        # stderr until its hook returns, and this one never returns: write to the real stderr.
        sys.stderr = sys.__stderr__ or sys.stderr
        if threading.current_thread() is threading.main_thread():
            # The MPI launcher answers the abort below with SIGINT to every rank, this one included.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        comm = _current
        rank = comm.rank if comm is not None else "?"
        if (
            isinstance(error, CommError)
            and not isinstance(error, CommTimeoutError)
            and comm
            and comm.backend == "torch"
        ):
            # A peer failed first and its traceback is the one that matters.
            sys.stderr.write(f"hpdl: rank {rank} stopping: {error}\n")
        elif isinstance(error, KeyboardInterrupt):
            # Ctrl-C, or the MPI launcher stopping the job after another rank failed: where it was, in one line.
            sys.stderr.write(f"hpdl: rank {rank} interrupted {_where(tb)}; stopping every rank of the job\n")
        else:
            sys.stderr.write(f"hpdl: rank {rank} failed; stopping every rank of the job\n")
            previous(kind, error, tb)  # the user's own hook, or Python's traceback
        sys.stderr.flush()
        sys.stdout.flush()
        # mpiexec forwards output through pipes and may drop what is still in them when the
        # abort tears the job down: give it a moment, so the traceback's last line arrives.
        time.sleep(0.5)
        if "hpdl.comm.mpi_backend" in sys.modules:
            from hpdl.comm.mpi_backend import MPI

            MPI.COMM_WORLD.Abort(1)
        os._exit(1)

    abort_job._hpdl = True  # type: ignore[attr-defined]
    sys.excepthook = abort_job


def _where(tb: Any) -> str:
    """'at script.py:12 in step': the innermost frame outside hpdl and runpy, else the innermost."""
    frames = traceback.extract_tb(tb)
    if not frames:
        return "before it ran"
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    own = [f for f in frames if not f.filename.startswith(package) and "runpy" not in f.filename]
    frame = (own or frames)[-1]
    return f"at {frame.filename}:{frame.lineno} in {frame.name}"
