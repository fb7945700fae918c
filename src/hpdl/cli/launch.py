"""`hpdl launch -n N [options] [python [python-options]] script.py [args]`: N local ranks, ended as one job.

The command line takes what people already type for `mpirun`, `horovodrun`
and `torchrun`: `-n`/`-np`/`--nproc-per-node`, an optional `python` before
the script, `-m module`. Everything after the script (or module) belongs to
it and passes through untouched, `--help` included. The work is done by
`hpdl.runtime.spawn`: if any rank fails the others are stopped and its exit
code is returned; Ctrl-C reaches every rank. On clusters keep
`mpirun`/`srun`: `hpdl.init()` detects them.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Optional

import hpdl.settings as settings
from hpdl.runtime import hosts, spawn
from hpdl.runtime.environment import RESTART_COUNT

__all__ = ["add_parser", "parse", "run_argv"]

FORMS = """\
forms (everything after the script or module is the script's own):
  hpdl launch -n 2 train.py --lr 0.1
  hpdl launch -n 2 python train.py --lr 0.1        as with mpirun -np 2 python train.py
  hpdl launch -np 2 python train.py                 as with horovodrun -np 2 python train.py
  hpdl launch --nproc-per-node 2 train.py           as with torchrun --nproc-per-node 2 train.py
  hpdl launch -n 2 -m package.module --flag         or: hpdl launch -n 2 python -m package.module
  hpdl launch -n 2 --backend torch train.py         ranks over torch.distributed (gloo) instead of MPI
  hpdl launch -n 4 -H a:2,b:2 train.py              2 ranks on each of hosts a and b (as horovodrun -H)
  hpdl launch -n 8 --hostfile hosts train.py        the hosts of a hostfile (`host slots=N` or `host:N` lines)
  hpdl launch -n 4 -H a:2,b:2 --max-restarts 1 train.py   a failed job starts again on the hosts still reachable
"""

RANK_OPTIONS = ("-n", "-np", "--np", "--nprocs", "--nproc-per-node", "--nproc_per_node")
HOST_OPTIONS = ("-H", "--hosts", "--host")
VALUE_OPTIONS = (
    *RANK_OPTIONS,
    *HOST_OPTIONS,
    "--hostfile",
    "--launcher-exec",
    "--max-restarts",
    "--backend",
    "--timeout",
    "-m",
)
PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")
# Interpreter options that may stand between `python` and the script; those with a value take the next word.
PYTHON_FLAGS = {"-u", "-O", "-OO", "-B", "-E", "-s", "-S", "-I", "-b", "-bb", "-q", "-v"}
PYTHON_VALUE_FLAGS = {"-W", "-X"}


@dataclass
class Command:
    """A parsed `hpdl launch` line: the launcher's options and what each rank runs."""

    options: argparse.Namespace
    target: list[str]
    """What follows `python -m hpdl.runtime.run_rank`: a script and its arguments, or `-m module ...`."""
    python_options: list[str] = field(default_factory=list)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpdl launch",
        description="Start N local ranks of a Python script or module; stop them all if one fails.",
        epilog=FORMS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(*RANK_OPTIONS, dest="nprocs", type=int, metavar="N", help="number of ranks")
    parser.add_argument(*HOST_OPTIONS, dest="hosts", metavar="H:N,...", help="run on these hosts (a:2,b:2)")
    parser.add_argument("--hostfile", metavar="FILE", help="run on the hosts of an mpirun-style hostfile")
    parser.add_argument(
        "--launcher-exec", default="ssh", metavar="RSH", help="the remote shell that reaches the hosts (ssh)"
    )
    parser.add_argument(
        "--max-restarts", type=int, default=0, metavar="K",
        help="start a failed job again, up to K times, on the hosts still reachable (HPDL_RESTART_COUNT)",
    )  # fmt: skip
    parser.add_argument("--backend", choices=("mpi", "torch"), default="mpi", help="communication backend (mpi)")
    parser.add_argument("--tag-output", action="store_true", help="prefix every output line with its rank")
    parser.add_argument("--timeout", type=float, help="seconds any collective may wait (HPDL_TIMEOUT)")
    parser.add_argument("--debug", action="store_true", help="compare collective fingerprints (HPDL_DEBUG=1)")
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run a module (like python -m) instead of a script")
    parser.add_argument("program", nargs="*", metavar="[python] script.py [args]", help="what every rank runs")
    return parser


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    subparsers.add_parser("launch", help="start N local ranks of a Python script", add_help=False)


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """The launcher's own words, and the program's (from the first word that is not a launcher option on)."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if not word.startswith("-") or word == "-":
            break
        name, joined = word.split("=", 1)[0], "=" in word
        step = 1 if joined or name not in VALUE_OPTIONS else 2
        if name == "-m":  # the module ends the launcher's words, as in python -m
            return argv[: i + step], argv[i + step :]
        i += step
    return argv[:i], argv[i:]


def _strip_python(program: list[str]) -> tuple[list[str], list[str], Optional[str]]:
    """`python [options] script ...` -> (interpreter options, `script ...`, the python named), as mpirun runs it."""
    if not program or not PYTHON.match(os.path.basename(program[0])):
        return [], program, None
    named, rest, options = program[0], program[1:], []
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        flag = rest.pop(0)
        if flag in PYTHON_VALUE_FLAGS and rest:
            options += [flag, rest.pop(0)]
        elif flag in PYTHON_FLAGS or flag[:2] in PYTHON_VALUE_FLAGS:
            options.append(flag)
        else:
            raise ValueError(f"python option {flag!r} is not supported by hpdl launch; put the script first")
    return [o for o in options if o != "-u"], rest, named  # ranks always run unbuffered


def parse(argv: list[str]) -> Command:
    """Parse a launch line; ValueError with the fix for a line that cannot run."""
    own, program = _split(argv)
    parser = _parser()
    options = parser.parse_args(own)
    if options.nprocs is None:
        raise ValueError("say how many ranks: -n N (or -np N, --nproc-per-node N)")
    if options.nprocs < 1:
        raise ValueError(f"-n {options.nprocs}: need at least one rank")
    if options.max_restarts < 0:
        raise ValueError(f"--max-restarts {options.max_restarts}: give 0 or more")
    if options.hosts and options.hostfile:
        raise ValueError("give the hosts once: -H a:2,b:2 or --hostfile FILE")
    options.host_list = hosts.parse_hosts(options.hosts) if options.hosts else None
    if options.hostfile:
        options.host_list = hosts.parse_hostfile(options.hostfile)
    if options.host_list is not None:
        options.host_list.placement(options.nprocs)  # enough slots
    python_options, program, named = _strip_python(program)
    if options.module is None and program[:1] == ["-m"]:
        if len(program) < 2:
            raise ValueError("python -m: name the module to run")
        options.module, program = program[1], program[2:]
    if named is not None and os.path.sep in named and os.path.realpath(named) != os.path.realpath(sys.executable):
        print(f"hpdl launch: ranks run {sys.executable} (where hpdl is installed), not {named}", file=sys.stderr)
    if options.module:
        return Command(options, ["-m", options.module, *program], python_options)
    if not program:
        raise ValueError("name a script (or -m module) to run; see hpdl launch --help")
    if not os.path.exists(program[0]):
        raise FileNotFoundError(f"script {program[0]!r} not found")
    return Command(options, program, python_options)


def bad_setting() -> Optional[str]:
    """The first bad value among the set HPDL_* settings (the registry checks each as its reader would), said once
    here instead of as a traceback on every rank; unknown HPDL_* names get their warning here too."""
    settings.warn_unknown(say=lambda message: print(f"hpdl launch: warning: {message}", file=sys.stderr))
    found = settings.problems()
    return found[0] if found else None


def run_argv(argv: list[str]) -> int:
    try:
        command = parse(argv)
    except (ValueError, OSError) as error:
        print(f"hpdl launch: {error}", file=sys.stderr)
        return 2
    options = command.options
    problem = bad_setting()
    if problem:
        print(f"hpdl launch: {problem}", file=sys.stderr)
        return 2
    nprocs, host_list = options.nprocs, options.host_list
    for restart in range(options.max_restarts + 1):
        env = spawn.job_environment(options.backend, nprocs, hosts=host_list)
        env[RESTART_COUNT] = str(restart)
        if options.timeout is not None:
            env["HPDL_TIMEOUT"] = str(options.timeout)
        if options.debug:
            env["HPDL_DEBUG"] = "1"
        try:
            code = spawn.run(
                nprocs,
                command.target,
                backend=options.backend,
                env=env,
                tag_output=options.tag_output,
                python_options=command.python_options,
                hosts=host_list,
                rsh=options.launcher_exec,
            )
        except FileNotFoundError as missing:
            print(f"hpdl launch: {missing}", file=sys.stderr)
            return 127
        if code in (0, spawn.INTERRUPTED) or restart == options.max_restarts:
            return code
        if host_list is not None:
            host_list, lost = hosts.reachable(host_list, options.launcher_exec)
            if host_list is None:
                print(f"hpdl launch: no host is reachable ({'; '.join(lost)}): not restarting", file=sys.stderr)
                return code
            before, nprocs = nprocs, min(nprocs, host_list.total)
            where = f" on {host_list.spec(nprocs)}" + (f", without {'; '.join(lost)}" if lost else "")
            print(f"hpdl launch: restart {restart + 1} of {options.max_restarts}{where} ({before} -> {nprocs} ranks)")
        else:
            print(f"hpdl launch: restart {restart + 1} of {options.max_restarts} after exit code {code}")
        sys.stdout.flush()
    return code
