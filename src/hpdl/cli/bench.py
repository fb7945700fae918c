"""`hpdl bench KIND [options]`: run a benchmark; each kind parses its own options."""

from __future__ import annotations

import argparse

__all__ = ["add_parser"]

KINDS = ("comm",)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "bench", help="side-by-side benchmarks (comm)", description="Run a benchmark; see `hpdl bench comm --help`."
    )
    parser.add_argument("kind", choices=KINDS, help="which benchmark")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="options of that benchmark")
    parser.set_defaults(handler=run)


def run(options: argparse.Namespace) -> int:
    from hpdl.bench import comm

    return comm.launch(list(options.options))
