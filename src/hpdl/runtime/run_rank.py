"""Run one rank's script so that a non-zero exit ends the whole MPI job, as an exception does.

MPICH's `mpiexec` lets the other ranks run on when one calls `sys.exit(3)`;
they would wait in their next collective until it times out. `hpdl launch`
therefore starts each rank as `python -m hpdl.runtime.run_rank script.py ...`,
which turns a non-zero `SystemExit` into `MPI_Abort` with that code, and
tells `finalize` not to wait at the exit barrier for ranks that will never
come (on torch the launcher stops the others). It first takes over the
stdout and stderr the launcher handed it (`hpdl.runtime.rank_output`), and
under MPICH's forking launcher reports a fatal signal to it
(`hpdl.runtime.rank_faults`).
"""

from __future__ import annotations

import io
import os
import runpy
import sys
from typing import MutableMapping

from hpdl.runtime.environment import STORE_FD
from hpdl.runtime.rank_failure import guard_stops, report_exit, report_failure, report_interrupt, supervised
from hpdl.runtime.rank_faults import watch
from hpdl.runtime.rank_output import adopt

__all__: list[str] = []


def main() -> None:
    adopt()  # before anything prints
    watch()  # a fatal signal (SIGBUS, SIGSEGV) reaches the launcher with its traceback
    # Ranks run with `python -u`, where print() writes its text and its newline in two calls: ranks that
    # share one terminal would splice lines together. Line buffering writes each line in one call.
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m hpdl.runtime.run_rank script.py [args] | -m module [args]")
    local_ranks()
    if STORE_FD in os.environ:  # rank 0 of a torch job: a script may call torch's own init_process_group
        from hpdl.runtime.store import serve_handed_store

        serve_handed_store()
    as_module = sys.argv[1] == "-m"
    sys.argv = sys.argv[2:] if as_module else sys.argv[1:]
    if supervised():
        guard_stops()
    try:
        if as_module:
            runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
        else:
            # as `python script.py`: the script's folder first, not the working one (unless -P / PYTHONSAFEPATH,
            # which Python 3.11 added: sys.flags has no safe_path before)
            if not getattr(sys.flags, "safe_path", False):
                sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if code == 0:
            _leave_a_broken_job()
            raise
        if supervised():
            if not isinstance(stop.code, int) and stop.code is not None:
                print(stop.code, file=sys.stderr)  # sys.exit("message"): what Python would print at exit
            report_exit(code)
        _abort_mpi_job(code)
        raise
    except KeyboardInterrupt as interrupt:
        if not supervised():
            raise
        report_interrupt(interrupt)
    except BaseException as error:
        if not supervised():
            raise  # hpdl.init's excepthook shows it and stops the job
        report_failure(error)
    _leave_a_broken_job()


def _leave_a_broken_job() -> None:
    """The script caught a communication failure and ended as if all was well: MPI_Finalize at exit would wait on
    the lost ranks (a host that is unreachable: for ever). Under `hpdl launch` the rank ends now, with code 1."""
    if not supervised() or "hpdl.runtime.world" not in sys.modules:
        return
    from hpdl.runtime.world import broken

    comm = broken()
    if comm is not None:
        report_exit(1, f"ended after a communication failure on {comm.backend} (its script went on): exit code 1")


def local_ranks(env: MutableMapping[str, str] = os.environ) -> None:
    """This rank's place on its host, in the variables Hydra and torchrun give (MPI_LOCALRANKID, LOCAL_RANK).

    MPICH's forking launcher sets none of them; `hpdl launch` gives every rank the host's count
    (MPI_LOCALNRANKS, LOCAL_WORLD_SIZE), and each rank adds its own place. Libraries read them: Accelerate
    takes a job without them for a multi-node one and asks for MASTER_ADDR.
    """
    if "MPI_LOCALNRANKS" in env and "PMI_RANK" in env and "MPI_LOCALRANKID" not in env:
        env["MPI_LOCALRANKID"] = env["PMI_RANK"]  # one host: the local place is the rank
        env.setdefault("LOCAL_RANK", env["PMI_RANK"])


def _abort_mpi_job(code: int) -> None:
    """Under a launcher that lets the other ranks run on when one exits (MPICH's mpiexec): end the job."""
    if "hpdl.runtime.world" in sys.modules:
        from hpdl.runtime.world import abandon

        abandon()
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
            print(f"hpdl: rank {MPI.COMM_WORLD.Get_rank()} exited with code {code}; stopping the job", file=sys.stderr)
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(code)


if __name__ == "__main__":
    main()
