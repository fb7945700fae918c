"""`hpdl bench train --strategy dp`: whole training steps of hpdl DataParallel beside PyTorch DDP, in one launch.

Contenders, on the same ranks, data, initial model and optimizer, alternating
per round (A B C D E A B C D E ...) so that drift on a shared machine hits
them alike:

    hpdl-mpi        hpdl.parallel.DataParallel over hpdl.init("mpi")   (mpi4py + shared memory)
    hpdl-mpi-noshm  the same with comm.shared_memory = False (plain MPI)
    hpdl-gloo       hpdl.parallel.DataParallel over hpdl.init("torch") (gloo)
    hpdl.horovod    a Horovod user's script on `import hpdl.horovod as hvd` (DistributedOptimizer, MPI)
    ddp-gloo        torch.nn.parallel.DistributedDataParallel on gloo (its defaults)
    independent     every rank trains its own model, no communication (the ceiling)
    single          rank 0 alone, the other ranks asleep (the scaling reference)

A step is the whole step: forward, loss, backward (with the gradient
allreduce), optimizer (SGD with momentum); synthetic data already in memory
(no data loading). Weak scaling: the per-rank batch is fixed, the global
batch grows with the ranks. Exposed communication = a contender's step time
minus `independent`'s (the same compute with no communication).

Run it with `hpdl bench train [--strategy dp] [-n 2] [--quick]` (this
module's `launch`), which starts `mpiexec -n N python -m hpdl.bench.train --worker ...`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from hpdl.bench import report
from hpdl.bench import strategy_harness as harness
from hpdl.bench.arguments import positive
from hpdl.bench.strategy_harness import Options, Ranks

__all__ = ["launch", "main"]

CONTENDERS = ("hpdl-mpi", "hpdl-mpi-noshm", "hpdl-gloo", "hpdl.horovod", "ddp-gloo", "independent", "single")
SAME_TRAJECTORY = ("hpdl-mpi", "hpdl-mpi-noshm", "hpdl-gloo", "hpdl.horovod", "ddp-gloo")
MODELS = {"mlp": 64, "cnn": 32}
"""Model name -> per-rank batch."""
TARGET_VS_DDP = 1.10
FLOOR_VS_DDP = 1.0
LR = 0.01


STRATEGY_MODULES = {
    "zero": "hpdl.bench.train_zero",
    "pipeline": "hpdl.bench.train_pipeline",
    "hybrid": "hpdl.bench.train_hybrid",
    "spatial": "hpdl.bench.train_spatial",
    "gems": "hpdl.bench.train_gems",
    "branch": "hpdl.bench.train_branch",
}
"""`--strategy` values other than dp, each measured by its own module (with its own `launch(argv)`)."""


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), help="models (default: mlp cnn)")
    parser.add_argument("--bucket-mb", type=positive(float), default=25.0, help="hpdl bucket size (default 25)")


def _check(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    if ns.ranks < 2:
        parser.error(f"-n {ns.ranks}: data parallelism needs at least 2 ranks")
    return {"models": tuple(ns.models or ("mlp", "cnn")), "bucket_mb": ns.bucket_mb}


BENCH = harness.Bench(
    strategy="dp",
    module="hpdl.bench.train",
    description="Samples/s of whole training steps: hpdl DataParallel (MPI, gloo) beside PyTorch DDP (gloo), "
    "independent processes (ceiling) and one process (scaling reference), alternating in one launch.",
    out="bench-results/train",
    rounds=(7, 2),
    steps=(10, 2),
    warmup=(5, 1),
    timeout=1200.0,
    quick_help="few rounds and steps (a smoke test, seconds)",
    strategies=("dp", *STRATEGY_MODULES),
    options=_options,
    check=_check,
)


def _strategy(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--strategy" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--strategy="):
            return arg.split("=", 1)[1]
    return "dp"


def launch(argv: list[str]) -> int:
    """Start the benchmark on its ranks (mpiexec beside this Python) and return its exit code."""
    strategy = _strategy(argv)
    if strategy in STRATEGY_MODULES:
        import importlib

        return int(importlib.import_module(STRATEGY_MODULES[strategy]).launch(argv))
    return harness.launch(BENCH, argv)


# --------------------------------------------------------------------------- models and contenders
def build_model(name: str) -> Any:
    from torch import nn

    if name == "mlp":
        return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * 8 * 8, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def make_batches(name: str, batch: int, rank: int, count: int = 4) -> list:
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    shape = (batch, 784) if name == "mlp" else (batch, 3, 32, 32)
    return [(torch.randn(shape, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(count)]


@dataclass
class Contender:
    name: str
    model: Any
    optimizer: Any
    sync: Callable[[], Any]
    """The engine's own barrier before a sample."""
    active: bool = True
    """False on ranks that only wait (single: every rank but 0)."""
    steps_done: int = 0
    last_loss: float = float("nan")


def make_contenders(name: str, mpi: Any, gloo: Any, bucket_mb: float) -> list[Contender]:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hpdl.parallel import DataParallel

    def fresh() -> Any:
        torch.manual_seed(0)
        return build_model(name)

    def sgd(model: Any) -> Any:
        return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)

    def gloo_barrier() -> None:
        dist.barrier()

    def mpi_barrier() -> None:
        mpi.barrier()

    out = []
    for contender in CONTENDERS:
        model: Any
        if contender == "hpdl-mpi":
            model = DataParallel(fresh(), mpi, bucket_mb=bucket_mb)
        elif contender == "hpdl-mpi-noshm":  # the same over plain MPI: what the shared-memory path buys
            plain = mpi.split(0, mpi.rank)
            plain.shared_memory = False
            model = DataParallel(fresh(), plain, bucket_mb=bucket_mb)
        elif contender == "hpdl-gloo":
            model = DataParallel(fresh(), gloo, bucket_mb=bucket_mb)
        elif contender == "ddp-gloo":
            model = DistributedDataParallel(fresh())
        elif contender == "hpdl.horovod":
            from hpdl.bench.train_horovod import horovod_contender

            model, optimizer = horovod_contender(fresh(), sgd, bucket_mb)
            out.append(Contender(contender, model, optimizer, mpi_barrier))
            continue
        else:
            model = fresh()
        # single: the idle ranks wait in gloo's barrier, which sleeps (an MPI barrier would spin on a core)
        sync = mpi_barrier if contender.startswith("hpdl-mpi") else gloo_barrier
        out.append(Contender(contender, model, sgd(model), sync, active=contender != "single" or mpi.rank == 0))
    return out


def run_steps(c: Contender, batches: list, steps: int) -> None:
    import torch.nn.functional as F

    for _ in range(steps):
        x, y = batches[c.steps_done % len(batches)]
        c.optimizer.zero_grad()
        loss = F.cross_entropy(c.model(x), y)
        loss.backward()
        c.optimizer.step()
        c.steps_done += 1
    c.last_loss = float(loss.detach())


def measure_model(name: str, options: Options, mpi: Any, gloo: Any) -> list[dict[str, Any]]:
    import torch

    batch = MODELS[name]
    batches = make_batches(name, batch, mpi.rank)
    contenders = make_contenders(name, mpi, gloo, options.bucket_mb)
    for c in contenders:  # warm up: allocation, first-touch, engine connections
        c.sync()
        if c.active:
            run_steps(c, batches, options.warmup)
        c.sync()

    def run(i: int) -> None:
        if contenders[i].active:
            run_steps(contenders[i], batches, options.steps)

    times = harness.alternate(len(contenders), options.rounds, run, lambda i: contenders[i].sync(), mpi)
    reference = [p.detach() for p in contenders[CONTENDERS.index("ddp-gloo")].model.module.parameters()]
    losses = np.array([c.last_loss for c in contenders])
    records = []
    for i, c in enumerate(contenders):
        ranks = 1 if c.name == "single" else mpi.size
        samples = [batch * ranks * options.steps / t for t in times[i]]
        stats = report.summarize(samples)
        module = getattr(c.model, "module", c.model)
        diff = None
        if c.name in SAME_TRAJECTORY:
            diff = max(float((a.detach() - b).abs().max()) for a, b in zip(module.parameters(), reference))
        records.append(
            {
                "model": name,
                "contender": c.name,
                "ranks": ranks,
                "batch_per_rank": batch,
                "global_batch": batch * ranks,
                "steps_per_sample": options.steps,
                "samples_per_s": stats,
                "step_ms": float(np.median(times[i])) / options.steps * 1e3,
                "loss": float(losses[i]),
                "max_param_diff_vs_ddp": diff,
                "params": sum(p.numel() for p in module.parameters()),
                "dtype": str(torch.get_default_dtype()).replace("torch.", ""),
            }
        )
    return records


# --------------------------------------------------------------------------- report
def analyse(records: list[dict[str, Any]]) -> tuple[list[list[Any]], list[str]]:
    rows, verdicts = [], []
    for model in dict.fromkeys(r["model"] for r in records):
        mine = {r["contender"]: r for r in records if r["model"] == model}
        ddp = mine["ddp-gloo"]["samples_per_s"]["median"]
        single = mine["single"]["samples_per_s"]["median"]
        ceiling = mine["independent"]
        for name, r in mine.items():
            s = r["samples_per_s"]
            r["vs_ddp"] = s["median"] / ddp
            r["scaling_efficiency"] = s["median"] / (single * r["ranks"]) if name != "single" else 1.0
            r["of_ceiling"] = s["median"] / ceiling["samples_per_s"]["median"]
            exposed = r["step_ms"] - ceiling["step_ms"] if name not in ("independent", "single") else None
            r["exposed_comm_ms"] = exposed
            rows.append(
                [
                    model,
                    name,
                    s["median"],
                    f"{s['min']:.0f}-{s['max']:.0f}",
                    r["vs_ddp"],
                    r["scaling_efficiency"],
                    r["of_ceiling"],
                    r["step_ms"],
                    exposed,
                    r["loss"],
                    r["max_param_diff_vs_ddp"],
                ]
            )
        ratio = mine["hpdl-mpi"]["vs_ddp"]
        verdicts.append(harness.faster(f"{model}: hpdl-mpi", ratio, "DDP's samples/s", TARGET_VS_DDP))
        if "hpdl.horovod" in mine:
            from hpdl.bench.train_horovod import verdicts as horovod_verdicts

            verdicts.extend(horovod_verdicts(model, mine))
        for name in ("hpdl-mpi", "hpdl-gloo"):
            low = mine[name]["vs_ddp"]
            verdicts.append(f"{report.verdict(low >= FLOOR_VS_DDP)} {model}: {name} {low:.2f}x DDP (never below 1.0x)")
    return rows, verdicts


HEADERS = [
    "model",
    "contender",
    "samples/s (median)",
    "min-max",
    "vs DDP",
    "scaling eff.",
    "of ceiling",
    "step ms",
    "exposed comm ms",
    "loss",
    "max |param diff| vs DDP",
]


def write_report(ranks: Ranks, options: Options, records: list[dict[str, Any]], elapsed: float) -> None:
    rows, verdicts = analyse(records)
    table = report.markdown_table(HEADERS, rows, right_align_from=2)
    config = harness.config(
        options,
        ranks,
        bucket_mb=options.bucket_mb,
        optimizer="SGD(lr=0.01, momentum=0.9)",
        ddp="DistributedDataParallel defaults (bucket_cap_mb=25)",
    )
    header = (
        f"hpdl bench train --strategy {options.strategy}: {options.ranks} ranks, OMP_NUM_THREADS=1, "
        f"MPI {config['mpi_engine']}, torch {config['torch_version']}, bucket {options.bucket_mb} MB, "
        f"{options.rounds} rounds x {options.steps} steps, SGD momentum 0.9, float32, weak scaling "
        f"(mlp 784-1024-1024-10 batch {MODELS['mlp']}/rank, cnn 3x32x32 batch {MODELS['cnn']}/rank)"
    )
    notes = [
        "samples/s = global batch x steps / sample time (slowest rank); min-max over rounds.",
        "scaling eff. = samples/s / (ranks x single's samples/s); of ceiling = vs independent (no communication).",
        "exposed comm ms = step time - independent's step time (the same compute without communication).",
        "loss = the last step's loss on rank 0; DDP-equivalent contenders train the same trajectory.",
        "Horovod: not importable here, so no column.",
    ]
    harness.write(options, "train", ("hpdl bench train", header, [table], notes, verdicts), records, config, elapsed)


def parse(argv: list[str]) -> Options:
    return harness.parse(BENCH, argv)


def main(argv: Optional[list[str]] = None) -> int:
    """`launch` by default; with --worker, `worker` (every rank)."""
    return harness.main(BENCH, launch, worker, argv)


def worker(options: Options) -> int:
    """The worker (every rank): both communicators in one process, every contender, report on rank 0."""

    def measure(ranks: Ranks) -> list[dict[str, Any]]:
        return [r for name in options.models for r in measure_model(name, options, ranks.mpi, ranks.gloo)]

    return harness.worker(
        measure,
        lambda ranks, records, elapsed: write_report(ranks, options, records, elapsed),
        announce=lambda r: (
            f"hpdl bench train: {r.size} ranks, MPI {r.mpi.engine}, torch {r.gloo.engine}; measuring ..."
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
