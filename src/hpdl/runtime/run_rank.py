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

from hpdl.runtime.environment import STORE_FD
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
    if STORE_FD in os.environ:  # rank 0 of a torch job: a script may call torch's own init_process_group
        from hpdl.runtime.store import serve_handed_store

        serve_handed_store()
    as_module = sys.argv[1] == "-m"
    sys.argv = sys.argv[2:] if as_module else sys.argv[1:]
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
        if code != 0 and "hpdl.runtime.world" in sys.modules:
            from hpdl.runtime.world import abandon

            abandon()
        if code != 0 and "mpi4py.MPI" in sys.modules:
            from mpi4py import MPI

            if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
                print(
                    f"hpdl: rank {MPI.COMM_WORLD.Get_rank()} exited with code {code}; stopping the job", file=sys.stderr
                )
                sys.stderr.flush()
                MPI.COMM_WORLD.Abort(code)
        raise


if __name__ == "__main__":
    main()
