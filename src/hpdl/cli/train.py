"""`hpdl train --model pkg.mod:factory --data pkg.mod:loader --plan plan.toml`: a planner's file trained, no code.

With `-n N` it starts N local ranks as `hpdl launch -n N` does (`--max-restarts`
and `--backend` too), each running `python -m hpdl.train.run`; without `-n`
this process is one rank (under `hpdl launch`, mpirun, srun or torchrun, or
alone). `hpdl train --help` lists the options (hpdl.train.run).
"""

from __future__ import annotations

__all__ = ["run_argv"]


def run_argv(argv: list[str]) -> int:
    from hpdl.train import run

    launch_args, rest = [], []
    words = iter(argv)
    for word in words:
        name, eq, value = word.partition("=")
        if name in run.LAUNCH_OPTIONS:
            launch_args += [name, value if eq else next(words, "")]
        else:
            rest.append(word)
    if "-h" in rest or "--help" in rest or not launch_args:
        return int(run.main(argv))
    try:
        run.build_parser().parse_args(argv)  # bad options stop here, before any rank starts
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 2
    from hpdl.cli import launch

    return launch.run_argv([*launch_args, "-m", "hpdl.train.run", *rest])
