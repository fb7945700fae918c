"""`hpdl bench cluster`: collectives across two simulated hosts with shaped links, against the link bound.

For each link rate (default 1gbit and 10gbit) it makes a two-host cluster (`hpdl.runtime.sim_cluster`, root),
starts `hpdl launch -n 4 -H a:2,b:2` on host a, and times, alternating the contenders size by size:
- allreduce: hpdl's default (hierarchical: reduced in shared memory inside each host, one leader per host across
  the link), hpdl flat (`comm.shared_memory = False`: plain MPI), and MPICH's own `Allreduce` through mpi4py;
- allgather and reduce-scatter: hpdl against mpi4py's `Allgather` / `Reduce_scatter_block`.
Each median is printed as a fraction of the link bound: the least bytes a host must send across its link divided
by the link's rate (allreduce of S bytes per rank: S, a leader sending its host's sum, as reduce-scatter then
all-gather between two hosts do; allgather of s per rank: the host's 2s; reduce-scatter of S per rank: S/2, the
other host's half of the host's sum).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Optional

from hpdl.bench import report

__all__ = ["launch", "main"]

RANKS, HOSTS = 4, ("a", "b")
CONTENDERS = {
    "allreduce": ("hpdl hierarchical", "hpdl flat", "MPI"),
    "allgather": ("hpdl", "MPI"),
    "reduce_scatter": ("hpdl", "MPI"),
}


@dataclass
class Options:
    links: list[str] = field(default_factory=lambda: ["1gbit", "10gbit"])
    sizes: list[int] = field(default_factory=lambda: [1 << 20, 16 << 20])
    reps: int = 7
    out: str = "bench-results/cluster"
    timeout: float = 900.0
    worker: bool = False
    link: str = ""
    """The worker's link rate (one of `links`)."""

    def forwarded(self) -> list[str]:
        sizes = [str(s) for s in self.sizes]
        return ["--worker", "--link", self.link, "--reps", str(self.reps), "--out", self.out, "--sizes", *sizes]


def parse(argv: list[str]) -> Options:
    parser = argparse.ArgumentParser(prog="hpdl bench cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--links", default="1gbit,10gbit", help="link rates, tc's units (default 1gbit,10gbit)")
    parser.add_argument("--sizes", nargs="+", type=report.parse_bytes, help="bytes per rank (default 1M 16M)")
    parser.add_argument("--reps", type=int, default=7, help="timed calls per contender and size (default 7)")
    parser.add_argument("--quick", action="store_true", help="one link (1gbit), 1 MiB, 3 calls: seconds")
    parser.add_argument("--out", default="bench-results/cluster", help="output folder")
    parser.add_argument("--timeout", type=float, default=900.0, help="stop a link's job after this many s")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--link", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    options = Options(
        links=[r for r in args.links.split(",") if r], reps=args.reps, out=args.out, timeout=args.timeout,
        worker=args.worker, link=args.link,
    )  # fmt: skip
    if args.sizes:
        options.sizes = args.sizes
    if args.quick:
        options.links, options.sizes, options.reps = ["1gbit"], [1 << 20], 3
    for rate in options.links:
        bits_per_second(rate)  # a bad rate fails here, before any namespace is made
    return options


def bits_per_second(rate: str) -> float:
    """tc's rate units: '1gbit' -> 1e9, '100mbit' -> 1e8, '500kbit' (decimal multiples, as tc reads them)."""
    text = rate.strip().lower()
    for suffix, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if text.endswith(suffix):
            try:
                return float(text[: -len(suffix)]) * scale
            except ValueError:
                break
    raise ValueError(f"link rate {rate!r}: write it as tc does, e.g. 1gbit, 100mbit")


def link_bound(op: str, nbytes: int, rate: str) -> float:
    """Seconds the bytes a host must send across its link take at `rate` (see the module's docstring)."""
    sent = {"allreduce": nbytes, "allgather": 2 * nbytes, "reduce_scatter": nbytes / 2}[op]
    return sent * 8 / bits_per_second(rate)


def launch(argv: list[str]) -> int:
    """Each link: a cluster, the worker on its 4 ranks from host a, then the cluster removed."""
    try:
        options = parse(list(argv))
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 0
    except ValueError as error:
        print(f"hpdl bench cluster: {error}", file=sys.stderr)
        return 2
    from hpdl.runtime import sim_cluster

    why = sim_cluster.available()
    if why:
        print(f"hpdl bench cluster: needs a simulated cluster, which cannot be made here: {why}", file=sys.stderr)
        return 2
    name = "hpdlbench"
    code = 0
    for rate in options.links:
        options.link = rate
        cluster = sim_cluster.up(len(HOSTS), rate, name)
        try:
            line = [
                sys.executable, "-m", "hpdl.cli.main", "launch", "-n", str(RANKS), "-H", "a:2,b:2",
                "--launcher-exec", sim_cluster.remote_shell(), "-m", "hpdl.bench.cluster", *options.forwarded(),
            ]  # fmt: skip
            argv_on_a = [sys.executable, "-m", "hpdl.cli.main", "cluster", "--name", name, "exec", "a", *line]
            env = dict(os.environ, HPDL_CLUSTER=name, OMP_NUM_THREADS="1")
            print(f"hpdl bench cluster: {RANKS} ranks on hosts a and b, links at {rate}", flush=True)
            done = subprocess.run(argv_on_a, env=env, timeout=options.timeout)
            code = code or done.returncode
        finally:
            sim_cluster.down(cluster.name)
    return code


def worker(options: Options) -> int:
    import hpdl

    started = perf_counter()
    hier = hpdl.init("mpi", timeout=120.0)
    flat = hier.split(0, hier.rank)
    assert flat is not None
    flat.shared_memory = False  # type: ignore[attr-defined]  # plain MPI: no shared memory in a host, no leaders
    records = []
    for op, contenders in CONTENDERS.items():
        for nbytes in options.sizes:
            times = _time_contenders(op, nbytes, contenders, options.reps, hier, flat)
            for contender, samples in times.items():
                stats = report.summarize(samples)
                bound = link_bound(op, nbytes, options.link)
                records.append(
                    {"op": op, "bytes": nbytes, "contender": contender, "link": options.link, **stats,
                     "link_bound_s": bound, "fraction_of_bound": bound / stats["median"]}
                )  # fmt: skip
    if hier.rank == 0:
        _write(options, records, hier, perf_counter() - started)
    hier.barrier()
    hpdl.finalize()
    return 0


def _time_contenders(
    op: str, nbytes: int, contenders: tuple[str, ...], reps: int, hier: Any, flat: Any
) -> dict[str, list[float]]:
    """Seconds per call of each contender (the slowest rank's), A B C A B C ..., after one warm-up call each."""
    import numpy as np
    import torch
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    count = nbytes // 4
    x = torch.ones(count)
    whole = torch.ones(count * RANKS)
    out = torch.empty(count * RANKS)
    block = torch.empty(count)

    def call(contender: str) -> None:
        if op == "allreduce":
            if contender == "MPI":
                world.Allreduce(MPI.IN_PLACE, x.numpy(), op=MPI.SUM)
            else:
                (hier if contender == "hpdl hierarchical" else flat).allreduce(x)
        elif op == "allgather":
            if contender == "MPI":
                world.Allgather(x.numpy(), out.numpy())
            else:
                hier.allgather(x, out=out)
        elif contender == "MPI":
            world.Reduce_scatter_block(whole.numpy(), block.numpy(), op=MPI.SUM)
        else:
            hier.reduce_scatter(whole, out=block)

    samples: dict[str, list[float]] = {c: [] for c in contenders}
    for rep in range(reps + 1):
        for contender in contenders if rep % 2 == 0 else contenders[::-1]:
            world.Barrier()
            start = perf_counter()
            call(contender)
            mine = np.array([perf_counter() - start])
            slowest = np.empty(1)
            world.Allreduce(mine, slowest, op=MPI.MAX)
            if rep:  # the first round warms up (buffers, shared memory, connections)
                samples[contender].append(float(slowest[0]))
    return samples


def _write(options: Options, records: list[dict[str, Any]], comm: Any, elapsed: float) -> None:
    def mpi_of(record: dict[str, Any]) -> dict[str, Any]:
        return next(
            r for r in records if r["op"] == record["op"] and r["bytes"] == record["bytes"] and r["contender"] == "MPI"
        )

    rows = []
    for record in records:
        mpi = mpi_of(record)
        rows.append(
            [record["op"], report.format_bytes(record["bytes"]), record["contender"],
             f"{record['median'] * 1e3:.1f}", f"{record['min'] * 1e3:.1f}-{record['max'] * 1e3:.1f}",
             f"{record['fraction_of_bound']:.0%}", f"{mpi['median'] / record['median']:.2f}x"]
        )  # fmt: skip
    table = report.markdown_table(
        ["op", "per rank", "contender", "median ms", "min-max ms", "of link bound", "vs MPI"], rows, right_align_from=3
    )
    hierarchical = [r for r in records if r["op"] == "allreduce" and r["contender"] == "hpdl hierarchical"]
    largest = max(hierarchical, key=lambda r: r["bytes"])
    mpi_largest = mpi_of(largest)
    targets = [
        f"{report.verdict(largest['fraction_of_bound'] >= 0.85)} hierarchical allreduce at "
        f"{report.format_bytes(largest['bytes'])}: {largest['fraction_of_bound']:.0%} of the link bound (>= 85%)",
        f"{report.verdict(mpi_largest['median'] / largest['median'] >= 1.1)} hierarchical allreduce "
        f"{mpi_largest['median'] / largest['median']:.2f}x MPICH's allreduce (>= 1.1x)",
    ]
    header = (
        f"{comm.size} ranks on 2 simulated hosts (2 each), each host's link shaped to {options.link} (tbf, both "
        f"directions), float32, {options.reps} timed calls per contender and size after a warm-up, alternating; "
        f"the slowest rank's time per call. MPI: {comm.engine}. 2 cores shared by all 4 ranks."
    )
    notes = [
        "link bound: the bytes a host must send across its link / the link rate (allreduce S, allgather 2s, "
        "reduce-scatter S/2 per host)",
        "hpdl flat: the same communicator with shared memory off (plain MPI); hpdl hierarchical: reduced in shared "
        "memory inside each host, one leader per host across the link",
    ]
    markdown = report.markdown_document(f"hpdl bench cluster ({options.link})", header, [table], notes, targets)
    config = {"ranks": comm.size, "hosts": 2, "link": options.link, "reps": options.reps, "mpi": comm.engine}
    report.write_report(options.out, f"cluster-{options.link}", markdown, records, config, elapsed)


def main(argv: Optional[list[str]] = None) -> int:
    return report.run_main(argv, parse, launch, worker)


if __name__ == "__main__":
    sys.exit(main())
