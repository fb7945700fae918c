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
import sys
from typing import Any, Optional

from hpdl.bench import report
from hpdl.bench import strategy_harness as harness
from hpdl.bench.arguments import positive
from hpdl.bench.strategy_harness import Options, Ranks

__all__ = ["launch", "main", "CONTENDERS", "inception_branches"]

CONTENDERS = ("single", "branch", "dp")
LR = 0.01


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", nargs="+", type=positive(int), help="batch sizes (default 1 4 32)")


def _check(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    if not 2 <= ns.ranks <= 4:
        parser.error(f"-n {ns.ranks}: the block has 4 branches; use 2 to 4 ranks")
    return {"batches": tuple(ns.batches or (1, 4, 32))}


BENCH = harness.Bench(
    strategy="branch",
    module="hpdl.bench.train_branch",
    description="Samples/s of branch parallelism beside one process and DataParallel for a 4-branch CNN.",
    out="bench-results/branch",
    rounds=(7, 2),
    steps=(5, 2),
    warmup=(2, 1),
    ranks_help="ranks (at most 4)",
    quick_help="a smaller model, few rounds (a smoke test)",
    options=_options,
    check=_check,
)


def parse(argv: list[str]) -> Options:
    return harness.parse(BENCH, argv)


def launch(argv: list[str]) -> int:
    return harness.launch(BENCH, argv)


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

    def run(i: int) -> None:
        for s in range(options.steps):
            step(names[i], s)

    times = harness.alternate(len(names), options.rounds, run, lambda i: comm.barrier(), comm)
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
    return harness.worker(
        lambda ranks: [r for batch in options.batches for r in measure(options, ranks.mpi, batch)],
        lambda ranks, records, elapsed: write_report(ranks, options, records, elapsed),
        gloo=False,
    )


def write_report(ranks: Ranks, options: Options, records: list[dict[str, Any]], elapsed: float) -> None:
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
        f"hpdl bench train --strategy branch: {ranks.size} ranks, 4-branch Inception-style CNN "
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
    text = ("hpdl bench train --strategy branch", header, [table], notes, None)
    harness.write(options, "branch", text, records, harness.config(options, ranks), elapsed)


def main(argv: Optional[list[str]] = None) -> int:
    return harness.main(BENCH, launch, worker, argv)


if __name__ == "__main__":
    sys.exit(main())
