"""`hpdl demo`: the main job (what `make demo` runs)."""

from __future__ import annotations

import argparse

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train a small CNN on scikit-learn's digits on 2 MPI ranks and write a report",
        description="Train a small CNN on scikit-learn's digits data set with data parallelism.",
    )
    parser.add_argument("options", nargs=argparse.REMAINDER, help="options of the demo (see `hpdl demo --help`)")


def run_argv(argv: list[str]) -> int:
    from hpdl.train import demo

    return int(demo.launch(argv))
