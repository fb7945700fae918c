"""`hpdl bench train --strategy branch`: branch parallelism beside one process and DataParallel, small batches.

A 4-branch Inception-style CNN (stem conv, a block of 1x1 / 1x1-3x3 /
1x1-5x5 / pool-1x1 branches concatenated along channels, pooled linear
head), float32, SGD with momentum, at batch sizes 1, 4 and 32. Contenders,
alternating per round:

    single   rank 0 alone runs the whole model on the whole batch
    branch   BranchParallel over the ranks (branches placed by measured cost)
    dp       DataParallel over the ranks, each rank on batch / ranks rows
             (not run where the batch does not split: batch 1 on 2 ranks)

Reported: samples/s (median, min-max) and the ratios; where branch
parallelism wins (small batches, which data parallelism cannot split) and
where it loses (large batches: its allgather and the replicated stem and
head cost more than data parallelism's one gradient allreduce).

Run it with `hpdl bench train --strategy branch [-n 2] [--quick] [--batches 1 4 32]`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from hpdl.bench import report
from hpdl.bench.comm import _positive

__all__ = ["launch", "main", "CONTENDERS", "inception_branches"]

CONTENDERS = ("single", "branch", "dp")
LR = 0.01


@dataclass(frozen=True)
class Options:
    ranks: int = 2
    quick: bool = False
    out: str = "bench-results/branch"
    batches: tuple[int, ...] = (1, 4, 32)
    rounds: int = 7
    steps: int = 5
    warmup: int = 2
    timeout: float = 1800.0
    worker: bool = False

    def forwarded(self) -> list[str]:
        args = ["--strategy", "branch", "--worker", "--out", os.path.abspath(self.out), "--rounds", str(self.rounds)]
        args += ["--steps", str(self.steps), "--batches", *map(str, self.batches)]
        return args + (["--quick"] if self.quick else [])


def parse(argv: Sequence[str]) -> Options:
    parser = argparse.ArgumentParser(
        prog="hpdl bench train --strategy branch",
        description="Samples/s of branch parallelism beside one process and DataParallel for a 4-branch CNN.",
    )
    parser.add_argument("--strategy", default="branch", choices=["branch"], help=argparse.SUPPRESS)
    parser.add_argument("-n", "--ranks", type=_positive(int), default=2, help="ranks (default 2; at most 4)")
    parser.add_argument("--quick", action="store_true", help="a smaller model, few rounds (a smoke test)")
    parser.add_argument("--out", default="bench-results/branch", help="output folder (default bench-results/branch)")
    parser.add_argument("--batches", nargs="+", type=_positive(int), help="batch sizes (default 1 4 32)")
    parser.add_argument("--rounds", type=_positive(int), help="timed rounds (default 7)")
    parser.add_argument("--steps", type=_positive(int), help="steps per timed sample (default 5)")
    parser.add_argument("--timeout", type=_positive(float), default=1800.0, help="stop the job after this many s")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args(list(argv))
    if not 2 <= ns.ranks <= 4:
        parser.error(f"-n {ns.ranks}: the block has 4 branches; use 2 to 4 ranks")
    return Options(
        ranks=ns.ranks, quick=bool(ns.quick), out=ns.out, batches=tuple(ns.batches or (1, 4, 32)),
        rounds=ns.rounds or (2 if ns.quick else 7), steps=ns.steps or (2 if ns.quick else 5),
        warmup=1 if ns.quick else 2, timeout=ns.timeout, worker=bool(ns.worker),
    )  # fmt: skip


def launch(argv: list[str]) -> int:
    return report.launch_benchmark("hpdl bench train --strategy branch", "hpdl.bench.train_branch", parse, argv)


def inception_branches(c: int) -> list:
    """Four branches of different cost on c channels: 1x1; 1x1-3x3; 1x1-5x5; 3x3 max-pool-1x1 (3c channels out)."""
    from torch import nn

    return [
        nn.Sequential(nn.Conv2d(c, c, 1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(c, c // 2, 1), nn.ReLU(), nn.Conv2d(c // 2, c, 3, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(c, c // 4, 1), nn.ReLU(), nn.Conv2d(c // 4, c // 2, 5, padding=2), nn.ReLU()),
        nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(c, c // 2, 1), nn.ReLU()),
    ]


def model(c: int, block: Any) -> Any:
    from torch import nn

    return nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), block, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(3 * c, 10))  # fmt: skip


def measure(options: Options, comm: Any, batch: int) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI

    from hpdl.parallel import DataParallel
    from hpdl.parallel.branch import BranchParallel

    c, hw = (16, 16) if options.quick else (64, 32)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(batch, 3, hw, hw, generator=g), torch.randint(0, 10, (batch,), generator=g))
            for _ in range(3)]  # fmt: skip
    names = [n for n in CONTENDERS if n != "dp" or batch % comm.size == 0]
    built = {}
    for name in names:
        torch.manual_seed(0)
        branches = inception_branches(c)
        if name == "branch":
            sample = torch.randn(batch, c, hw, hw)
            net = model(c, BranchParallel(torch.nn.ModuleList(branches), "concat", comm, sample=sample))
        else:
            net = model(c, _Concat(branches))
            if name == "dp":
                net = DataParallel(net, comm)
        built[name] = (net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9))
    rows = batch // comm.size
    part = slice(comm.rank * rows, (comm.rank + 1) * rows)

    def step(name: str, b: int) -> None:
        net, opt = built[name]
        x, y = data[b % len(data)]
        if name == "single" and comm.rank != 0:
            return
        if name == "dp":
            x, y = x[part], y[part]
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()

    for name in names:
        for b in range(options.warmup):
            step(name, b)
    times = np.zeros((len(names), options.rounds))
    for r in range(options.rounds):
        for i, name in enumerate(names):
            comm.barrier()
            started = time.perf_counter()
            for s in range(options.steps):
                step(name, s)
            times[i, r] = time.perf_counter() - started
    comm.barrier()
    comm.mpi_comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    block = built["branch"][0][2]
    records = []
    for i, name in enumerate(names):
        records.append({
            "batch": batch, "contender": name, "ranks": 1 if name == "single" else comm.size,
            "samples_per_s": report.summarize([batch * options.steps / t for t in times[i]]),
            "placement": block.placement if name == "branch" else None,
            "branch_seconds": block.costs if name == "branch" else None,
        })  # fmt: skip
    return records


class _Concat:
    """The one-process block (all branches, concatenated): a module built lazily to keep torch imports local."""

    def __new__(cls, branches: list) -> Any:
        import torch
        from torch import nn

        class Concat(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.branches = nn.ModuleList(branches)

            def forward(self, x: Any) -> Any:
                return torch.cat([b(x) for b in self.branches], 1)

        return Concat()


def worker(options: Options) -> int:
    import torch

    import hpdl

    started = time.perf_counter()
    torch.set_num_threads(1)
    comm = hpdl.init("mpi", timeout=300.0, debug=False)
    records = []
    for batch in options.batches:
        records += measure(options, comm, batch)
    if comm.rank == 0:
        rows = []
        for batch in options.batches:
            mine = {r["contender"]: r for r in records if r["batch"] == batch}
            single = mine["single"]["samples_per_s"]["median"]
            for name, r in mine.items():
                s = r["samples_per_s"]
                r["vs_single"] = s["median"] / single
                r["vs_dp"] = s["median"] / mine["dp"]["samples_per_s"]["median"] if "dp" in mine else None
                rows.append([batch, name, s["median"], f"{s['min']:.1f}-{s['max']:.1f}", r["vs_single"], r["vs_dp"]])
        placement = next(r for r in records if r["contender"] == "branch")
        header = (
            f"hpdl bench train --strategy branch: {comm.size} ranks, 4-branch Inception-style CNN "
            f"({'16 channels, 16x16' if options.quick else '64 channels, 32x32'}), float32, OMP_NUM_THREADS=1, "
            f"{options.rounds} rounds x {options.steps} steps, alternating per round"
        )
        notes = [
            f"branch placement (rank of each branch) {placement['placement']}, measured forward+backward seconds "
            f"per branch {[round(v, 4) for v in placement['branch_seconds']]} (batch {placement['batch']}).",
            "dp: DataParallel, each rank on batch / ranks rows; not run where the batch does not split.",
            "single: rank 0 alone (the other ranks idle).",
        ]
        table = report.markdown_table(["batch", "contender", "samples/s", "min-max", "vs single", "vs dp"], rows)
        text = report.markdown_document("hpdl bench train --strategy branch", header, [table], notes)
        config = report.environment(benchmark="train", strategy="branch", quick=options.quick, world_ranks=comm.size,
                                    rounds=options.rounds, mpi_engine=comm.engine)  # fmt: skip
        report.write_report(options.out, "branch", text, records, config, time.perf_counter() - started)
    comm.barrier()
    hpdl.finalize()
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    return report.run_main(argv, parse, launch, worker)


if __name__ == "__main__":
    sys.exit(main())
