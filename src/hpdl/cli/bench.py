"""`hpdl bench KIND [options]`: run a benchmark; each kind parses its own options."""

from __future__ import annotations

import argparse
import importlib

__all__ = ["add_parser"]

KINDS = {
    "comm": "hpdl.bench.comm",
    "train": "hpdl.bench.train",
    "ml": "hpdl.bench.ml",
    "dask": "hpdl.bench.dask_transport",
    "gpu": "hpdl.bench.gpu_check",
    "torch": "hpdl.bench.torch_backend",
    "cluster": "hpdl.bench.cluster",
    "keras": "hpdl.bench.keras",
}


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="side-by-side benchmarks (comm, train) and the GPU check (gpu)",
        description="Run a benchmark; see `hpdl bench comm --help`, `hpdl bench train --help`.",
    )
    parser.add_argument("kind", choices=sorted(KINDS), help="which benchmark")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="options of that benchmark")


def run_argv(kind: str, argv: list[str]) -> int:
    module = importlib.import_module(KINDS[kind])
    return int(module.launch(argv))
