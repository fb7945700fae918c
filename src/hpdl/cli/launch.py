"""`hpdl launch -n N [--backend mpi|torch] script.py [args]`: start N local ranks and end them as one job.

The work is done by `hpdl.runtime.spawn`: MPI jobs go through the `mpiexec`
beside this Python (the `mpich` wheel) or the one on PATH, torch jobs get
torchrun-style variables; if any rank fails the others are stopped and its
exit code is returned; Ctrl-C is forwarded to every rank. On clusters keep
`mpirun`/`srun`: `hpdl.init()` detects them.
"""

from __future__ import annotations

import argparse
import os
import sys

from hpdl.runtime import spawn

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="start N local ranks of a Python script",
        description="Start N local ranks of a script; stop them all if one fails.",
    )
    parser.add_argument("-n", "--nprocs", type=int, required=True, help="number of ranks")
    parser.add_argument("--backend", choices=("mpi", "torch"), default="mpi", help="communication backend (mpi)")
    parser.add_argument("--tag-output", action="store_true", help="prefix every output line with its rank")
    parser.add_argument("--timeout", type=float, help="seconds any collective may wait (HPDL_TIMEOUT)")
    parser.add_argument("--debug", action="store_true", help="compare collective fingerprints (HPDL_DEBUG=1)")
    parser.add_argument("-m", dest="module", help="run a module (like python -m) instead of a script")
    parser.add_argument("script", nargs="?", help="the script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    parser.set_defaults(handler=run)


def run(options: argparse.Namespace) -> int:
    if options.nprocs < 1:
        print(f"hpdl launch: -n {options.nprocs}: need at least one rank", file=sys.stderr)
        return 2
    if options.module:
        target = ["-m", options.module] + ([options.script] if options.script else []) + options.args
    elif options.script:
        if not os.path.exists(options.script):
            print(f"hpdl launch: script {options.script!r} not found", file=sys.stderr)
            return 2
        target = [options.script] + options.args
    else:
        print("hpdl launch: name a script (or -m module) to run", file=sys.stderr)
        return 2
    env = spawn.job_environment(options.backend, options.nprocs)
    if options.timeout is not None:
        env["HPDL_TIMEOUT"] = str(options.timeout)
    if options.debug:
        env["HPDL_DEBUG"] = "1"
    try:
        return spawn.run(options.nprocs, target, backend=options.backend, env=env, tag_output=options.tag_output)
    except FileNotFoundError as missing:
        print(f"hpdl launch: {missing}", file=sys.stderr)
        return 127
