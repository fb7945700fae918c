"""`hpdl bench train --strategy gems`: GEMS-MASTER beside 1F1B and GPipe, same stages, micro-batches and data.

Contenders, all `hpdl.parallel.Pipeline` over MPI on the same ranks, with
the same split (equal layer counts), the same m micro-batches of the same
size, no recomputation, SGD with momentum, alternating per round:

    gems    schedule="gems": two mirrored replicas, m/2 micro-batches each
    1f1b    schedule="1f1b"
    gpipe   schedule="gpipe"

Per contender: samples/s (median, min-max), the measured bubble (the
ranks' idle share of the step: 1 - the mean over ranks of each rank's
compute-only time / step time, where compute-only is that rank's own
forwards and backwards of the step run alone), the step's excess over the
slowest rank's compute-only time (the bubble as the slowest rank sees it:
with unequal stages the faster ranks' idle time is not in it), hpdl's busy-time
bubble (1 - compute / step seconds, counted by the engine), the grid
bubble of the schedule, peak activation bytes per rank (ActivationMeter)
and parameter bytes per rank (gems holds two stages per rank). Targets:
gems' measured bubble at most half of 1F1B's, and samples/s >= 1.15x 1F1B.

Run it with `hpdl bench train --strategy gems [-n 2] [--quick] [--chunks 4]`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any, Callable, Optional

import numpy as np

from hpdl.bench import report
from hpdl.bench import strategy_harness as harness
from hpdl.bench.arguments import positive
from hpdl.bench.strategy_harness import Options, Ranks

__all__ = ["launch", "main", "CONTENDERS"]

CONTENDERS = ("gems", "1f1b", "gpipe")
TARGET_SPEEDUP, TARGET_BUBBLE_RATIO = 1.15, 0.5
LR = 0.01


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--models",
        nargs="+",
        choices=["act", "mlp", "transformer"],
        help="models (default: act mlp; act: activation-heavy, GEMS' regime)",
    )
    parser.add_argument("--chunks", type=positive(int), default=4, help="micro-batches per step, even (default 4)")


def _check(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    if ns.ranks < 2:
        parser.error(f"-n {ns.ranks}: a pipeline needs at least 2 ranks")
    if ns.chunks % 2:
        parser.error(f"--chunks {ns.chunks}: gems splits the micro-batches between two replicas; pass an even number")
    return {"models": tuple(ns.models or ("act", "mlp")), "chunks": ns.chunks}


BENCH = harness.Bench(
    strategy="gems",
    module="hpdl.bench.train_gems",
    description="Samples/s and bubble of GEMS-MASTER (two mirrored pipeline replicas) beside 1F1B and GPipe.",
    out="bench-results/gems",
    rounds=(7, 2),
    steps=(5, 2),
    warmup=(2, 1),
    ranks_help="ranks = stages",
    quick_help="small models, few rounds (a smoke test)",
    options=_options,
    check=_check,
)


def parse(argv: list[str]) -> Options:
    return harness.parse(BENCH, argv)


def launch(argv: list[str]) -> int:
    return harness.launch(BENCH, argv)


def activation_heavy(quick: bool) -> Any:
    """GEMS' regime: activations much larger than the weights (8 x Linear(256, 256), batch 8192: 24 MiB of
    activations per rank against 1.8 MiB of weights; with batch 2048 an action took 2-4 ms, and hpdl's fixed cost
    per action, about 0.3 ms, was half of what GEMS did not fill)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from hpdl.bench.train_pipeline import Workload

    width, batch, depth = (64, 256, 8) if quick else (256, 8192, 8)

    def layers() -> list:
        return [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth - 1)] + [nn.Linear(width, 10)]

    def data(g: Any) -> tuple:
        return torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)

    text = f"{depth} x Linear({width}, {width}) + ReLU, batch {batch} (activations >> weights)"
    return Workload("act", batch, text, layers, data, F.cross_entropy)


def _compute_only(
    pipe: Any, layers: list, counts: list[int], batch: tuple, chunks: int, loss: Any
) -> Callable[[], float]:
    """A timer of this rank's own forwards and backwards of one step, alone (no communication, no waiting): each
    call runs them once and returns the seconds. The benchmark calls it in every round, beside the steps it
    compares with (timed apart, a quiet minute or a busy one skewed the bubble: -0.08 to 0.3 for one schedule)."""
    import torch
    from torch import nn

    from hpdl.parallel.pipe import microbatch

    x, y = batch
    p, rank = len(counts), pipe.stage

    def stage(s: int) -> nn.Sequential:
        start = sum(counts[:s])
        return nn.Sequential(*layers[start : start + counts[s]])

    def inputs(s: int, xs: list) -> list:
        with torch.no_grad():
            before = nn.Sequential(*layers[: sum(counts[:s])])
            return [before(xk) for xk in xs]

    work = []  # (stage module, its micro-batch inputs, targets, last?)
    if getattr(pipe, "mirror_stage", None) is not None:
        halves = (microbatch.split(x, 2), microbatch.split(y, 2))
        for s, half in ((rank, 0), (p - 1 - rank, 1)):
            xs, ys = microbatch.split(halves[0][half], chunks // 2), microbatch.split(halves[1][half], chunks // 2)
            work.append((stage(s), inputs(s, xs), ys, s == p - 1))
    else:
        xs, ys = microbatch.split(x, chunks), microbatch.split(y, chunks)
        work.append((stage(rank), inputs(rank, xs), ys, rank == p - 1))

    def run() -> None:
        for module, xs, ys, last in work:
            for xk, yk in zip(xs, ys):
                arg = xk.detach().requires_grad_(xk.dtype.is_floating_point)
                out = module(arg)
                (loss(out, yk) if last else out).backward(None if last else torch.ones_like(out))

    def timed() -> float:
        started = time.perf_counter()
        run()
        return time.perf_counter() - started

    run()
    return timed


def measure_model(name: str, options: Options, comm: Any) -> list[dict[str, Any]]:
    import torch
    from mpi4py import MPI
    from torch import nn

    from hpdl.bench.train_pipeline import workload
    from hpdl.parallel import Pipeline
    from hpdl.parallel.pipe.balance import even
    from hpdl.parallel.pipe.memory import ActivationMeter

    w = activation_heavy(options.quick) if name == "act" else workload(name, options.quick)
    g = torch.Generator().manual_seed(1234)
    batches = [w.data(g) for _ in range(4)]
    counts = even(len(w.layers()), comm.size)
    pipes, opts = [], []
    for schedule in CONTENDERS:
        torch.manual_seed(0)
        pipe = Pipeline(nn.Sequential(*w.layers()), comm, chunks=options.chunks, schedule=schedule, balance=counts,
                        checkpoint="never")  # fmt: skip
        pipes.append(pipe)
        opts.append(torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9))

    def step(i: int, b: int) -> float:
        pipe = pipes[i]
        x, y = batches[b % len(batches)]
        loss = pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, w.loss)
        opts[i].step()
        opts[i].zero_grad()
        return float(loss)

    for i in range(len(pipes)):
        for b in range(options.warmup):
            step(i, b)
    peaks = np.zeros(len(pipes))
    for i, pipe in enumerate(pipes):
        comm.barrier()
        with ActivationMeter(exclude=list(pipe.parameters())) as meter:
            step(i, 0)
        peaks[i] = meter.peak
    param_bytes = np.array([sum(p.numel() * p.element_size() for p in pipe.parameters()) for pipe in pipes], float)
    alone = [_compute_only(pipe, w.layers(), counts, batches[0], options.chunks, w.loss) for pipe in pipes]
    times = np.zeros((len(pipes), options.rounds))
    busy = np.zeros((len(pipes), options.rounds))
    compute = np.zeros((len(pipes), options.rounds))
    done = options.warmup
    for r in range(options.rounds):
        for i in range(len(pipes)):
            comm.barrier()
            started = time.perf_counter()
            bubbles = []
            for s in range(options.steps):
                step(i, done + s)
                bubbles.append(pipes[i].stats.bubble)
            times[i, r] = time.perf_counter() - started
            busy[i, r] = float(np.mean(bubbles))
            compute[i, r] = alone[i]()
        done += options.steps
    world = comm.mpi_comm
    world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    world.Allreduce(MPI.IN_PLACE, busy, op=MPI.SUM)
    busy /= comm.size
    each_rank = np.zeros((comm.size, *compute.shape))
    world.Allgather(compute, each_rank)  # every rank's own compute-only time, round by round
    peak_table = np.zeros((comm.size, len(pipes)))
    world.Allgather(peaks, peak_table)
    param_table = np.zeros((comm.size, len(pipes)))
    world.Allgather(param_bytes, param_table)
    records = []
    for i, schedule in enumerate(CONTENDERS):
        step_s = float(np.median(times[i])) / options.steps
        step_times = times[i] / options.steps  # each round's compute beside its own steps
        slowest = each_rank[:, i].max(axis=0)
        idle, over_slowest = 1.0 - each_rank[:, i].mean(axis=0) / step_times, 1.0 - slowest / step_times
        grid = pipes[i].schedule(options.chunks).bubble
        records.append({
            "model": name, "workload": w.describe, "contender": schedule, "ranks": comm.size, "batch": w.batch,
            "microbatches": options.chunks,
            "samples_per_s": report.summarize([w.batch * options.steps / t for t in times[i]]),
            "step_ms": step_s * 1e3, "compute_only_ms": float(np.median(slowest)) * 1e3,
            "bubble_measured": float(np.median(idle)), "bubble_slowest_rank": float(np.median(over_slowest)),
            "bubble_busy": float(np.median(busy[i])),
            "bubble_grid": grid,
            "peak_activation_bytes_per_rank": peak_table[:, i].tolist(),
            "parameter_bytes_per_rank": param_table[:, i].tolist(),
        })  # fmt: skip
    for pipe in pipes:
        pipe.close()
    return records


HEADERS = ["model", "schedule", "samples/s", "min-max", "vs 1f1b", "bubble measured", "slowest rank's bubble",
           "busy-time bubble", "grid bubble", "peak activations MiB per rank", "parameters MiB per rank"]  # fmt: skip


def analyse(records: list[dict[str, Any]]) -> tuple[list[list[Any]], list[str]]:
    rows, verdicts = [], []
    for model in dict.fromkeys(r["model"] for r in records):
        mine = {r["contender"]: r for r in records if r["model"] == model}
        base = mine["1f1b"]
        for name, r in mine.items():
            s = r["samples_per_s"]
            r["vs_1f1b"] = s["median"] / base["samples_per_s"]["median"]
            rows.append([model, name, s["median"], f"{s['min']:.0f}-{s['max']:.0f}", r["vs_1f1b"], r["bubble_measured"],
                         r["bubble_slowest_rank"], r["bubble_busy"], r["bubble_grid"],
                         " / ".join(f"{v / 2**20:.1f}" for v in r["peak_activation_bytes_per_rank"]),
                         " / ".join(f"{v / 2**20:.1f}" for v in r["parameter_bytes_per_rank"])])  # fmt: skip
        g = mine["gems"]
        verdicts.append(harness.faster(f"{model}: gems", g["vs_1f1b"], "1f1b's samples/s", TARGET_SPEEDUP))
        ratio = g["bubble_measured"] / base["bubble_measured"] if base["bubble_measured"] > 0 else math.inf
        verdicts.append(
            f"{report.verdict(ratio <= TARGET_BUBBLE_RATIO)} {model}: gems measured bubble {g['bubble_measured']:.3f} "
            f"= {ratio:.2f}x 1f1b's {base['bubble_measured']:.3f} (target <= {TARGET_BUBBLE_RATIO}x)"
        )
    return rows, verdicts


def worker(options: Options) -> int:
    return harness.worker(
        lambda ranks: [r for name in options.models for r in measure_model(name, options, ranks.mpi)],
        lambda ranks, records, elapsed: write_report(ranks, options, records, elapsed),
        gloo=False,
        announce=lambda r: f"{r.size} ranks, MPI {r.mpi.engine}; measuring gems, 1f1b, gpipe ...",
    )


def write_report(ranks: Ranks, options: Options, records: list[dict[str, Any]], elapsed: float) -> None:
    rows, verdicts = analyse(records)
    header = (
        f"hpdl bench train --strategy gems: {options.ranks} ranks, {options.chunks} micro-batches of the same size "
        f"for every schedule (gems: {options.chunks // 2} per replica), equal layer counts, no recomputation, "
        f"OMP_NUM_THREADS=1, {options.rounds} rounds x {options.steps} steps, alternating per round"
    )
    notes = [
        "bubble measured = the ranks' idle share of the step: 1 - (mean over ranks of each rank's own forwards "
        "and backwards of a step, run alone in the same round) / step time; the median over rounds.",
        "slowest rank's bubble = 1 - (the slowest rank's own forwards and backwards) / step time: the same where "
        "the stages cost the same; with unequal stages the faster ranks' idle time is not in it.",
        "busy-time bubble = the engine's own count: 1 - compute seconds / step seconds (gems: both replicas and "
        "the gradient exchange).",
        "grid bubble = the schedule's idle fraction on its time grid (forward 1 slot, backward 2).",
        "gems holds two stages per rank: parameters (and optimizer state) x2, the price of its filled bubble.",
    ]
    table = report.markdown_table(HEADERS, rows, right_align_from=2)
    config = harness.config(options, ranks, chunks=options.chunks)
    text = ("hpdl bench train --strategy gems", header, [table], notes, verdicts)
    harness.write(options, "gems", text, records, config, elapsed)


def main(argv: Optional[list[str]] = None) -> int:
    return harness.main(BENCH, launch, worker, argv)


if __name__ == "__main__":
    sys.exit(main())
