"""`hpdl tune`: measure where this node's shared-memory collectives beat plain MPI, and write it for hpdl.init.

hpdl tune                      # as many ranks as cores (2-8), every operation, 64 KiB - 64 MiB
hpdl tune -n 4 8 --out F       # one entry per ranks-per-node; F instead of HPDL_TUNE_FILE / the default file
hpdl tune --quick              # three sizes, three rounds: a smoke test, not a measurement to keep

Each count of ranks is one MPI job on this machine (`python -m hpdl.cli.tune --worker`); the file keeps one entry
per ranks-per-node, merged with what it already holds for the same MPI library.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Optional, Sequence

from hpdl.bench.report import format_bytes, markdown_table, parse_bytes
from hpdl.comm import shm, tuning
from hpdl.comm.shm_probe import OPS, PATHS
from hpdl.errors import TuneFileError

__all__ = ["parser", "run_argv", "run", "main"]

_KIB = 1024
SIZES = [64 * _KIB << i for i in range(11)]  # 64 KiB .. 64 MiB
QUICK_SIZES = [256 * _KIB, 2048 * _KIB, 16384 * _KIB]


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpdl tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", "--ranks", type=_at_least_two, nargs="+", default=None,
                        help="ranks per node to measure, one job each (default: the cores, 2 to 8)")  # fmt: skip
    parser.add_argument("--out", default=None, help=f"the file (default: ${tuning.ENV}, else {tuning.default_path()})")
    parser.add_argument("--sizes", type=_size, nargs="+", default=None, help="message sizes (default 64K .. 64M)")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), help="operations (default: all)")
    parser.add_argument("--rounds", type=_at_least_two, default=None, help="alternating rounds per size (7)")
    parser.add_argument("--quick", action="store_true", help="three sizes, three rounds")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per job before it is stopped")
    return parser


def run_argv(argv: Sequence[str]) -> int:
    return run(parser().parse_args(argv))


def run(options: argparse.Namespace) -> int:
    from hpdl.runtime import spawn

    where = options.out or tuning.path()
    if where is None:
        print(f"hpdl tune: {tuning.ENV}=off and no --out: nowhere to write", file=sys.stderr)
        return 2
    counts = options.ranks or [min(max(os.cpu_count() or 2, 2), 8)]
    sizes = options.sizes or (QUICK_SIZES if options.quick else SIZES)
    rounds = options.rounds or (3 if options.quick else 7)
    for ranks in counts:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "measured.json")
            args = ["-m", "hpdl.cli.tune", "--worker", out, "--rounds", str(rounds), "--ops", *options.ops]
            args += ["--sizes", *map(str, sizes)]
            env = spawn.job_environment("mpi", ranks)
            env["OMP_NUM_THREADS"] = "1"
            env[tuning.ENV] = "off"  # measure from the built-in state, whatever the file says
            code = spawn.run(ranks, args, env=env, timeout=options.timeout, name="hpdl tune")
            if code != 0 or not os.path.exists(out):
                print(f"hpdl tune: the {ranks}-rank job failed (exit code {code}); nothing written for {ranks} ranks "
                      "per node", file=sys.stderr)  # fmt: skip
                return code or 1
            with open(out) as fh:
                measured = json.load(fh)
        local_size, mpi = measured["local_size"], measured["mpi"]
        built_in = {op: tuple(pair) for op, pair in measured["built_in"].items()}
        chosen = {**_kept(where, local_size, mpi, built_in)}
        chosen.update((op, tuple(pair)) for op, pair in measured["thresholds"].items())
        print(report(local_size, measured["results"], chosen))
        made = tuning.new(mpi, local_size, chosen, measured["results"])
        tuning.write(where, made)
    print(f"wrote {where}: hpdl.init reads it on this machine ({tuning.ENV} names another file; =off ignores it)")
    return 0


def _kept(where: str, local_size: int, mpi: str, built_in: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The thresholds of the operations this run does not measure: the file's own for this node size and MPI
    library, else `built_in`, what the measuring job's communicator used without a file (on two ranks: never
    for the operations that go as messages at every size)."""
    try:
        old = tuning.read(where)
    except TuneFileError:
        old = None  # replaced by this run
    if old is not None and old.mpi == mpi and local_size in old.per_node:
        return dict(old.per_node[local_size])
    return dict(built_in)


def report(local_size: int, results: dict[str, list[dict]], chosen: dict[str, Any]) -> str:
    """The measured table (time ratios to MPI: below 1 is faster) and the thresholds chosen from it."""
    rows = [
        [op, format_bytes(row["bytes"]), f"{row['mpi_us']:.0f}", *(f"{row[p]:.2f}x" for p in PATHS[1:])]
        for op, measured in results.items()
        for row in measured
    ]
    table = markdown_table(["op", "bytes", "MPI us", "zero-copy / MPI", "copied in / MPI"], rows)
    picked = "; ".join(f"{op} {_threshold(chosen[op][0])} / {_threshold(chosen[op][1])}" for op in results)
    return (
        f"\n{local_size} ranks per node: median time ratio of each shared-memory path to plain MPI\n\n{table}\n\n"
        f"shared memory from (shared buffers / ordinary tensors): {picked}\n"
        f"(a path is taken from the smallest size where it is at most {tuning.WIN:.2f}x MPI there and at every "
        "larger size measured)"
    )


def _threshold(nbytes: int) -> str:
    return "never" if nbytes >= shm.NEVER else format_bytes(nbytes)


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _at_least_two(text: str) -> int:
    value = int(text) if text.isdigit() else 0
    if value < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 2")
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The measuring job's entry (`python -m hpdl.cli.tune --worker OUT ...`, on every rank)."""
    parser = argparse.ArgumentParser(prog="python -m hpdl.cli.tune")
    parser.add_argument("--worker", required=True, help="where rank 0 writes the measurements")
    parser.add_argument("--sizes", type=int, nargs="+", required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--ops", nargs="+", choices=OPS, required=True)
    options = parser.parse_args(argv)
    import hpdl
    from hpdl.comm import shm_probe
    from hpdl.comm.mpi_backend import library_version

    comm = hpdl.init(backend="mpi")
    try:
        built_in = shm_probe.in_force(comm)  # (the job runs without a tuning file)
        results = shm_probe.measure(comm, options.sizes, options.rounds, options.ops)
        if comm.rank == 0:
            chosen = shm_probe.thresholds(results)
            data = {"local_size": comm.local_size, "mpi": library_version(), "results": results, "thresholds": chosen,
                    "built_in": built_in}  # fmt: skip
            with open(options.worker, "w") as fh:
                json.dump(data, fh)
    finally:
        hpdl.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
