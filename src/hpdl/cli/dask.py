"""`hpdl dask`: a Dask cluster on the ranks of an MPI job, over the mpi:// transport.

    hpdl dask -n 4 script.py [args]            start 4 ranks (mpiexec beside this Python) and run the script
    mpiexec -n 4 hpdl dask script.py [args]    the same under your own mpiexec / mpirun / srun
    mpiexec -n 4 hpdl dask --scheduler-file s.json    no script: serve until a client shuts the cluster down

Rank 0 runs the scheduler, rank 1 the script (a `distributed.Client` to the
cluster is already the default: `dask.compute`, `Client()` and
`get_client()` use it), the other ranks are workers. When the script ends
the cluster shuts down and every rank exits; the script's exit code is the
job's. If any rank dies, mpiexec ends the job.

Quiet by default: Dask's own log (the `distributed` loggers: every connection,
worker and shutdown step at INFO) shows only warnings and errors; `--verbose`
shows it all. The script's prints, warnings and logging are untouched.
"""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import sys
from typing import Any, Optional

__all__ = ["build_parser", "run_argv"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpdl dask",
        description="Run a Dask cluster on MPI ranks (rank 0 scheduler, rank 1 your script, others workers).",
    )
    parser.add_argument("-n", "--nprocs", type=int, help="start this many ranks with mpiexec (else: run under one)")
    parser.add_argument("--protocol", choices=("mpi", "tcp"), default="mpi", help="transport (default mpi)")
    parser.add_argument("--nthreads", type=int, default=1, help="threads per worker (default 1)")
    parser.add_argument("--memory-limit", default="auto", help="per worker, e.g. 4GB (default auto)")
    parser.add_argument("--local-directory", help="workers' scratch directory")
    parser.add_argument("--dashboard", action="store_true", help="start the scheduler's dashboard (needs bokeh)")
    parser.add_argument("--scheduler-file", help="without a script: write the scheduler's address here and serve")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for start-up (default 120)")
    parser.add_argument("--job-timeout", type=float, help="with -n: stop the whole job after this many seconds")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show Dask's INFO log (else only its warnings and errors)"
    )
    parser.add_argument("script", nargs="?", help="the client script (run on rank 1)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def run_argv(argv: list[str]) -> int:
    parser = build_parser()
    options = parser.parse_args(argv)
    if options.script is None and not options.scheduler_file:
        parser.error("name a script to run on rank 1, or give --scheduler-file to serve clients")
    if options.script is not None and not os.path.exists(options.script):
        parser.error(f"script {options.script!r} not found")
    if options.nprocs is not None:
        return _spawn(options, argv)
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() == 1:
        parser.error("run under mpiexec (mpiexec -n 4 hpdl dask script.py), or pass -n 4 to start the ranks")
    return _serve(options)


def _spawn(options: argparse.Namespace, argv: list[str]) -> int:
    from hpdl.runtime import spawn

    least = 3 if options.script else 2
    if options.nprocs < least:
        print(
            f"hpdl dask: -n {options.nprocs}: need at least {least} ranks (scheduler, client, worker)", file=sys.stderr
        )
        return 2
    inner = _without_nprocs(argv)
    env = spawn.job_environment("mpi", options.nprocs)
    try:
        code = spawn.run(
            options.nprocs, ["-m", "hpdl.cli.dask", *inner], env=env, timeout=options.job_timeout, name="hpdl dask"
        )
    except FileNotFoundError as missing:
        print(f"hpdl dask: {missing}", file=sys.stderr)
        return 127
    if code not in (0, spawn.TIMED_OUT, spawn.INTERRUPTED):
        print(
            f"hpdl dask: the job failed with exit code {code}: a rank exited or died (the script's error, or a "
            "lost scheduler/worker; MPI ends the whole job when one rank dies); see the messages above",
            file=sys.stderr,
        )
    return int(code)


OUTER_ONLY = ("-n", "--nprocs", "--job-timeout")
"""Options of the outer launch, not passed on to the ranks."""
WITH_VALUE = OUTER_ONLY + (
    "--protocol",
    "--nthreads",
    "--memory-limit",
    "--local-directory",
    "--scheduler-file",
    "--timeout",
)
"""Options followed by a value (which is not the script)."""


def _without_nprocs(argv: list[str]) -> list[str]:
    """The command line minus `-n N` / `--nprocs N` / `--job-timeout S` (options of the outer launch only)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in WITH_VALUE:
            if arg not in OUTER_ONLY:
                out += argv[i : i + 2]
            i += 2
            continue
        if arg.startswith(("--nprocs=", "--job-timeout=")) or (arg.startswith("-n") and arg[2:].isdigit()):
            i += 1
            continue
        if not arg.startswith("-"):  # the script: everything from here on is its own
            return out + argv[i:]
        out.append(arg)
        i += 1
    return out


def _serve(options: argparse.Namespace) -> int:
    if not options.verbose:
        _quiet_dask()
    from hpdl.dask.cluster import ClusterOptions, run_cluster

    cluster = ClusterOptions(
        protocol=options.protocol,
        nthreads=options.nthreads,
        memory_limit=options.memory_limit,
        local_directory=options.local_directory,
        dashboard=options.dashboard,
        timeout=options.timeout,
    )
    if options.script is None:
        run_cluster(None, cluster, scheduler_file=options.scheduler_file)
        return 0
    code = run_cluster(lambda client: _run_script(options.script, options.args), cluster)
    return int(code or 0)


def _quiet_dask() -> None:
    """Dask's own log at WARNING on this rank: distributed logs every connection, worker and shutdown step at
    INFO (57+ lines for a one-line result). Its warnings and errors still show, and so does everything of the
    script's own (prints, warnings, its loggers)."""
    import dask

    dask.config.set({"logging.distributed": "warning"})  # for anything that configures distributed's logging again
    import distributed  # noqa: F401 - importing it sets its loggers' levels from dask.config: set ours after

    logging.getLogger("distributed").setLevel(logging.WARNING)


def _run_script(script: str, args: list[str]) -> int:
    """Run the user's script as __main__ on rank 1; its SystemExit code becomes the job's exit code."""
    saved = sys.argv
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code: Optional[Any] = stop.code
        if code is None:
            return 0
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            return 1
        return code
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(run_argv(sys.argv[1:]))
