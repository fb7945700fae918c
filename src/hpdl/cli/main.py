"""The `hpdl` command: one entry point for launching, inspecting and benchmarking."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional

from hpdl.cli import bench, demo, info, launch

__all__ = ["main"]

RAW_COMMANDS = {
    "cluster": "a cluster of hosts on this machine (namespaces, shaped links) to run multi-host jobs on",
    "dask": "start a Dask cluster on MPI ranks over the mpi:// transport (under mpiexec)",
    "plan": "predict step time and memory of every parallel plan and pick the best",
    "tune": "measure where shared-memory collectives beat MPI on this machine; hpdl.init then uses it",
    "train": "train a model factory and a data loader with a plan file (hpdl plan --out), no code",
}
"""Commands that parse their own options, each in hpdl.cli.<name> with `run_argv(argv)`."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpdl", description="High-performance distributed training.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    launch.add_parser(subparsers)
    info.add_parser(subparsers)
    bench.add_parser(subparsers)
    demo.add_parser(subparsers)
    for name, help_text in RAW_COMMANDS.items():
        subparsers.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = sys.argv[1:] if argv is None else argv
    # `launch`, `demo` and `bench KIND` parse their own options (and print their own --help).
    if args[:1] == ["launch"]:
        return launch.run_argv(args[1:])
    if args[:1] == ["demo"]:
        return demo.run_argv(args[1:])
    if args[:1] and args[0] in RAW_COMMANDS:
        return int(importlib.import_module(f"hpdl.cli.{args[0]}").run_argv(args[1:]))
    if args[:1] == ["bench"] and len(args) > 1 and args[1] in bench.KINDS:
        return bench.run_argv(args[1], args[2:])
    options = parser.parse_args(args)
    if not getattr(options, "handler", None):
        parser.print_help()
        return 2
    return int(options.handler(options))


if __name__ == "__main__":
    sys.exit(main())
