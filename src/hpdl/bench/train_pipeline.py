"""`hpdl bench train --strategy pipeline`: hpdl's pipeline beside torch.distributed.pipelining, in one launch.

Contenders, on the same ranks (one stage per rank), the same split of the
same model, the same data, the same micro-batches and the same optimizer
(SGD with momentum), alternating per round so that drift on a shared
machine hits them alike:

    hpdl-mpi-gpipe / hpdl-mpi-1f1b     hpdl.parallel.Pipeline over hpdl.init("mpi")
    hpdl-gloo-gpipe / hpdl-gloo-1f1b   the same over hpdl.init("torch") (gloo)
    torch-gpipe / torch-1f1b           torch.distributed.pipelining (PipelineStage + ScheduleGPipe /
                                       Schedule1F1B) on gloo
    single                             rank 0 alone runs the whole model on the whole batch

No recomputation anywhere (torch's schedules do not recompute). Beside them,
two limits measured on the same ranks: "compute-only" (the slowest stage's
forward and backward of all micro-batches with no communication and no
waiting) and the bubble-limited ideal, compute-only x m / (m + p - 1).
The measured bubble of a contender is 1 - compute-only time / its step time,
printed next to (p - 1) / (m + p - 1). Peak activation memory per stage is
what autograd saved for backward at its peak during one step
(`hpdl.parallel.pipe.memory.ActivationMeter`, the same meter for everyone).

Run it with `hpdl bench train --strategy pipeline [-n 2] [--quick]`.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from hpdl.bench import report
from hpdl.bench import strategy_harness as harness
from hpdl.bench.arguments import positive
from hpdl.bench.strategy_harness import Options, Ranks

__all__ = ["launch", "main", "CONTENDERS", "contenders_here"]

CONTENDERS = (
    "hpdl-mpi-gpipe",
    "hpdl-mpi-1f1b",
    "hpdl-gloo-gpipe",
    "hpdl-gloo-1f1b",
    "torch-gpipe",
    "torch-1f1b",
    "single",
)
NOT_HERE = (
    "torch-1f1b: not run: this torch's Schedule1F1B deadlocks over gloo (it waits on one of the works that "
    "gloo's batch_isend_irecv returns; pytorch#132644, fixed by pytorch#152938)"
)
TARGET_VS_TORCH = 1.2
BUBBLE_SLACK = 0.10
LR = 0.01


def contenders_here() -> tuple[str, ...]:
    """CONTENDERS less the peer this torch cannot run: its 1F1B over gloo hangs (seen on torch 2.4.1) until
    the schedules wait on every work of a batch of point-to-point operations (`_wait_batch_p2p`)."""
    from torch.distributed.pipelining import schedules

    if hasattr(schedules, "_wait_batch_p2p"):
        return CONTENDERS
    return tuple(name for name in CONTENDERS if name != "torch-1f1b")


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", choices=["mlp", "transformer"], help="models (default: both)")
    parser.add_argument("--chunks", type=positive(int), default=8, help="micro-batches per step (default 8)")


def _check(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    if ns.ranks < 2:
        parser.error(f"-n {ns.ranks}: a pipeline needs at least 2 ranks (one stage each)")
    return {"models": tuple(ns.models or ("mlp", "transformer")), "chunks": ns.chunks}


BENCH = harness.Bench(
    strategy="pipeline",
    module="hpdl.bench.train_pipeline",
    description="Samples/s, bubble and activation memory of pipeline training: hpdl GPipe and 1F1B over MPI "
    "and gloo beside torch.distributed.pipelining, one process, and the compute-only limits, in one launch.",
    out="bench-results/pipeline",
    rounds=(7, 2),
    steps=(5, 2),
    warmup=(3, 1),
    ranks_help="ranks = pipeline stages",
    quick_help="small models, few rounds (a smoke test, seconds)",
    options=_options,
    check=_check,
)


def parse(argv: list[str]) -> Options:
    return harness.parse(BENCH, argv)


def launch(argv: list[str]) -> int:
    """Start the benchmark on its ranks (mpiexec beside this Python) and return its exit code."""
    return harness.launch(BENCH, argv)


# --------------------------------------------------------------------------- models
@dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    describe: str
    layers: Callable[[], list]
    data: Callable[[Any], tuple]
    loss: Callable[[Any, Any], Any]


def workload(name: str, quick: bool) -> Workload:
    import torch
    import torch.nn.functional as F
    from torch import nn

    if name == "mlp":
        width, batch, depth = (256, 64, 8) if quick else (1024, 256, 8)

        def mlp() -> list:
            return [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth - 1)] + [
                nn.Linear(width, width)
            ]

        def mlp_data(g: Any) -> tuple:
            return torch.randn(batch, width, generator=g), torch.randint(0, width, (batch,), generator=g)

        return Workload(name, batch, f"{depth} x Linear({width}, {width}) + ReLU, batch {batch}", mlp, mlp_data,
                        F.cross_entropy)  # fmt: skip

    d, heads, blocks, seq, vocab, batch = (32, 2, 4, 16, 64, 16) if quick else (256, 4, 4, 64, 128, 32)

    def transformer() -> list:
        return transformer_layers(vocab, d, heads, blocks, seq)

    def tokens(g: Any) -> tuple:
        x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def lm_loss(out: Any, y: Any) -> Any:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    text = f"transformer d={d} heads={heads} blocks={blocks} seq={seq} vocab={vocab}, batch {batch}"
    return Workload(name, batch, text, transformer, tokens, lm_loss)


def transformer_layers(vocab: int, d: int, heads: int, blocks: int, seq: int) -> list:
    """A small causal language model as a list of layers: embedding, pre-norm blocks, norm + head."""
    import torch
    from torch import nn

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(seq, d) * 0.02)

        def forward(self, x: Any) -> Any:
            return self.tok(x) + self.pos[: x.shape[1]]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            self.mask: torch.Tensor
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

        def forward(self, x: Any) -> Any:
            t = x.shape[1]
            return self.layer(x, src_mask=self.mask[:t, :t], is_causal=True)

    return [Embed(), *[Block() for _ in range(blocks)], nn.Sequential(nn.LayerNorm(d), nn.Linear(d, vocab))]


# --------------------------------------------------------------------------- contenders
@dataclass
class Contender:
    name: str
    step: Callable[[Any, Any], float]
    params: Callable[[], list]
    sync: Callable[[], Any]
    pipe: Any = None
    losses: list = field(default_factory=list)


def split_points(layers: int, ranks: int) -> list[int]:
    from hpdl.parallel.pipe.balance import even

    return even(layers, ranks)


def make_contenders(w: Workload, options: Options, mpi: Any, gloo: Any) -> list[Contender]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from hpdl.parallel import Pipeline

    rank, size = mpi.rank, mpi.size
    counts = split_points(len(w.layers()), size)
    start = sum(counts[:rank])
    first, last = rank == 0, rank == size - 1

    def fresh() -> list:
        torch.manual_seed(0)
        return w.layers()

    def stage_layers() -> nn.Sequential:
        return nn.Sequential(*fresh()[start : start + counts[rank]])

    def sgd(params: Any) -> Any:
        return torch.optim.SGD(params, lr=LR, momentum=0.9)

    out = []
    for name in contenders_here():
        if name.startswith("hpdl"):
            comm = mpi if "-mpi-" in name else gloo
            pipe = Pipeline(nn.Sequential(*fresh()), comm, chunks=options.chunks, schedule=name.split("-")[-1],
                            balance=counts, checkpoint="never")  # fmt: skip
            opt = sgd(pipe.parameters())

            def hpdl_step(x: Any, y: Any, pipe: Any = pipe, opt: Any = opt) -> float:
                loss = pipe.step(x if first else None, y if last else None, w.loss)
                opt.step()
                opt.zero_grad()
                return float(loss)

            sync = mpi.barrier if comm is mpi else dist.barrier
            out.append(Contender(name, hpdl_step, _params_of(pipe), sync, pipe))
        elif name.startswith("torch"):
            from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

            module = stage_layers()
            stage = _torch_stage(module, rank, size, nn.Sequential(*fresh()[:start]), w, options.chunks)
            kind = ScheduleGPipe if name.endswith("gpipe") else Schedule1F1B
            schedule, scale = _torch_schedule(kind, stage, options.chunks, w.loss)
            opt = sgd(module.parameters())

            def torch_step(x: Any, y: Any, schedule: Any = schedule, opt: Any = opt, scale: float = scale) -> float:
                losses: list = []
                if first:
                    schedule.step(x)
                elif last:
                    schedule.step(target=y, losses=losses)
                else:
                    schedule.step()
                opt.step()
                opt.zero_grad()
                return float(sum(float(v) for v in losses) * scale / len(losses)) if losses else math.nan

            out.append(Contender(name, torch_step, _params_of(module), dist.barrier))
        else:
            layers = fresh()
            whole = nn.Sequential(*layers)
            opt = sgd(whole.parameters())

            def single_step(x: Any, y: Any, whole: Any = whole, opt: Any = opt) -> float:
                if rank != 0:
                    return math.nan
                loss = w.loss(whole(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                return float(loss.detach())

            own = nn.Sequential(*layers[start : start + counts[rank]])
            out.append(Contender(name, single_step, _params_of(own), dist.barrier))
    return out


def _torch_stage(module: Any, rank: int, size: int, before: Any, w: Workload, chunks: int) -> Any:
    """torch.distributed.pipelining's stage of `module`; `before` is the layers of the stages ahead of it.

    The torch this was written for infers the shapes between stages at run time; older ones (2.4) need an
    example of the micro-batch the stage receives: the first micro-batch of one batch through `before`.
    """
    import inspect

    import torch
    from torch.distributed.pipelining import PipelineStage

    cpu = torch.device("cpu")
    if inspect.signature(PipelineStage).parameters["input_args"].default is not inspect.Parameter.empty:
        return PipelineStage(module, rank, size, cpu)
    x, _ = w.data(torch.Generator().manual_seed(0))
    with torch.no_grad():
        example = before(torch.tensor_split(x, chunks)[0])
    return PipelineStage(module, rank, size, cpu, input_args=example)


def _torch_schedule(kind: Any, stage: Any, chunks: int, loss: Callable) -> tuple[Any, float]:
    """A torch.distributed.pipelining schedule of `kind` over `stage`, and the factor its losses are reported by.

    The schedules average the micro-batches' gradients (`scale_grads`); older torch (2.4) sums them, and there
    each micro-batch's loss is divided by their number, so that every contender trains the same trajectory.
    """
    import inspect

    if "scale_grads" in inspect.signature(kind).parameters:
        return kind(stage, chunks, loss_fn=loss), 1.0
    return kind(stage, chunks, loss_fn=lambda out, y: loss(out, y) / chunks), float(chunks)


def _params_of(module: Any) -> Callable[[], list]:
    def params() -> list:
        return list(module.parameters())

    return params


def compute_only(w: Workload, options: Options, rank: int, size: int, batches: list) -> float:
    """Seconds of this stage's forward + backward of every micro-batch, alone (no communication, no waiting)."""
    import torch
    from torch import nn

    from hpdl.parallel.pipe import microbatch

    counts = split_points(len(w.layers()), size)
    start = sum(counts[:rank])
    torch.manual_seed(0)
    layers = w.layers()
    before, stage = nn.Sequential(*layers[:start]), nn.Sequential(*layers[start : start + counts[rank]])
    x, y = batches[0]
    xs, ys = microbatch.split(x, options.chunks), microbatch.split(y, options.chunks)
    with torch.no_grad():
        inputs = [before(xk) for xk in xs]
    last = rank == size - 1

    def run() -> None:
        for xk, yk in zip(inputs, ys):
            arg = xk.detach().requires_grad_(xk.dtype.is_floating_point)
            out = stage(arg)
            if last:
                w.loss(out, yk).backward()
            else:
                out.backward(torch.ones_like(out))

    for _ in range(options.warmup):
        run()
    times = []
    for _ in range(max(3, options.rounds)):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def peak_activation(c: Contender, batches: list) -> int:
    from hpdl.parallel.pipe.memory import ActivationMeter

    x, y = batches[0]
    c.sync()
    with ActivationMeter(exclude=c.params()) as meter:
        c.step(x, y)
    c.sync()
    return meter.peak


def measure_model(name: str, options: Options, mpi: Any, gloo: Any) -> list[dict[str, Any]]:
    import torch
    from mpi4py import MPI

    w = workload(name, options.quick)
    g = torch.Generator().manual_seed(1234)
    batches = [w.data(g) for _ in range(4)]  # the same data on every rank: stage 0 reads x, the last stage y
    contenders = make_contenders(w, options, mpi, gloo)
    for c in contenders:
        c.sync()
        for i in range(options.warmup):
            c.losses.append(c.step(*batches[i % len(batches)]))
        c.sync()
    peaks = np.array([peak_activation(c, batches) for c in contenders], dtype=np.float64)
    done = options.warmup + 1
    times = np.zeros((len(contenders), options.rounds))
    internal = np.zeros((len(contenders), options.rounds))
    for r in range(options.rounds):
        for i, c in enumerate(contenders):
            c.sync()
            started = time.perf_counter()
            bubbles = []
            for s in range(options.steps):
                c.losses.append(c.step(*batches[(done + s) % len(batches)]))
                if c.pipe is not None:
                    bubbles.append(c.pipe.stats.bubble)
            times[i, r] = time.perf_counter() - started
            internal[i, r] = float(np.mean(bubbles)) if bubbles else math.nan
            c.sync()
        done += options.steps
    world = mpi.mpi_comm
    world.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)  # a sample lasts until its slowest rank finishes
    internal_all = np.zeros_like(internal)
    world.Allreduce(internal, internal_all, op=MPI.SUM)
    internal_all /= mpi.size
    stage_seconds = world.allgather(compute_only(w, options, mpi.rank, mpi.size, batches))
    peak_table = np.zeros((mpi.size, len(contenders)))
    world.Allgather(peaks, peak_table)
    # every contender trained the same model on the same data: compare each stage's parameters
    reference = [p.detach() for p in contenders[contenders_here().index("hpdl-mpi-1f1b")].params()]
    diffs = np.array([max(float((a.detach() - b).abs().max()) for a, b in zip(c.params(), reference))
                      for c in contenders])  # fmt: skip
    world.Allreduce(MPI.IN_PLACE, diffs, op=MPI.MAX)
    losses = world.bcast([c.losses[-1] for c in contenders], root=mpi.size - 1)
    single_loss = world.bcast(contenders[-1].losses[-1], root=0)
    slowest = max(stage_seconds)
    p, m = mpi.size, min(options.chunks, w.batch)
    records = []
    for i, c in enumerate(contenders):
        samples = [w.batch * options.steps / t for t in times[i]]
        step_s = float(np.median(times[i])) / options.steps
        records.append(
            {
                "model": name,
                "workload": w.describe,
                "contender": c.name,
                "ranks": 1 if c.name == "single" else p,
                "batch": w.batch,
                "microbatches": m,
                "steps_per_sample": options.steps,
                "samples_per_s": report.summarize(samples),
                "step_ms": step_s * 1e3,
                "bubble_measured": None if c.name == "single" else 1.0 - slowest / step_s,
                "bubble_internal": None if math.isnan(internal_all[i].mean()) else float(np.median(internal_all[i])),
                "bubble_formula": (p - 1) / (m + p - 1),
                "peak_activation_bytes_per_stage": [float(v) for v in peak_table[:, i]]
                if c.name != "single"
                else [float(peak_table[0, i])],
                "stage_compute_ms": [s * 1e3 for s in stage_seconds],
                "compute_only_samples_per_s": w.batch / slowest,
                "ideal_samples_per_s": w.batch / slowest * m / (m + p - 1),
                "loss": single_loss if c.name == "single" else losses[i],
                "max_param_diff_vs_hpdl_mpi_1f1b": float(diffs[i]),
            }
        )
    return records


# --------------------------------------------------------------------------- report
HEADERS = [
    "model",
    "contender",
    "samples/s",
    "min-max",
    "vs torch (same schedule)",
    "of ideal",
    "bubble measured",
    "bubble (p-1)/(m+p-1)",
    "hpdl busy-time bubble",
    "peak activations MiB per stage",
    "loss",
    "max |param diff|",
]


def analyse(records: list[dict[str, Any]]) -> tuple[list[list[Any]], list[str], list[str]]:
    rows, verdicts, limits = [], [], []
    for model in dict.fromkeys(r["model"] for r in records):
        mine = {r["contender"]: r for r in records if r["model"] == model}
        any_record = next(iter(mine.values()))
        limits.append(
            f"{model} ({any_record['workload']}): compute-only {any_record['compute_only_samples_per_s']:.0f} "
            f"samples/s (stages {', '.join(f'{v:.1f}' for v in any_record['stage_compute_ms'])} ms per step), "
            f"bubble-limited ideal {any_record['ideal_samples_per_s']:.0f} samples/s"
        )
        for name, r in mine.items():
            s = r["samples_per_s"]["median"]
            peer = mine.get(f"torch-{name.split('-')[-1]}") if name.startswith("hpdl") else None
            r["vs_torch"] = s / peer["samples_per_s"]["median"] if peer else None
            r["of_ideal"] = s / r["ideal_samples_per_s"]
            peaks = " / ".join(f"{v / 2**20:.1f}" for v in r["peak_activation_bytes_per_stage"])
            rows.append(
                [model, name, s, f"{r['samples_per_s']['min']:.0f}-{r['samples_per_s']['max']:.0f}", r["vs_torch"],
                 r["of_ideal"], r["bubble_measured"], r["bubble_formula"] if name != "single" else None,
                 r["bubble_internal"], peaks, r["loss"], r["max_param_diff_vs_hpdl_mpi_1f1b"]]
            )  # fmt: skip
        for schedule in ("gpipe", "1f1b"):
            r = mine[f"hpdl-mpi-{schedule}"]
            if r["vs_torch"] is None:
                verdicts.append(f"n/a {model}: hpdl-mpi-{schedule}: no torch-{schedule} time to compare")
            else:
                verdicts.append(
                    harness.faster(
                        f"{model}: hpdl-mpi-{schedule}", r["vs_torch"], f"torch-{schedule}'s samples/s",
                        TARGET_VS_TORCH, f", {r['of_ideal']:.0%} of the bubble-limited ideal",
                    )
                )  # fmt: skip
            bound = r["bubble_formula"] * (1 + BUBBLE_SLACK)
            verdicts.append(
                f"{report.verdict(r['bubble_measured'] <= bound)} {model}: hpdl-mpi-{schedule} bubble "
                f"{r['bubble_measured']:.3f} vs formula {r['bubble_formula']:.3f} (target <= {bound:.3f}; stages "
                "balanced by layer count)"
            )
    return rows, verdicts, limits


def write_report(ranks: Ranks, options: Options, records: list[dict[str, Any]], elapsed: float) -> None:
    rows, verdicts, limits = analyse(records)
    table = report.markdown_table(HEADERS, rows, right_align_from=2)
    config = harness.config(
        options, ranks, chunks=options.chunks, checkpoint="never", optimizer=f"SGD(lr={LR}, momentum=0.9)"
    )
    header = (
        f"hpdl bench train --strategy pipeline: {options.ranks} ranks = {options.ranks} stages (equal layer counts), "
        f"{options.chunks} micro-batches, no recomputation, OMP_NUM_THREADS=1 and torch.set_num_threads(1) per "
        f"rank, MPI {config['mpi_engine']}, torch {config['torch_version']}, {options.rounds} rounds x "
        f"{options.steps} steps, SGD momentum 0.9, float32, synthetic data in memory"
    )
    notes = [
        "samples/s = batch x steps / sample time (slowest rank); min-max over rounds; contenders alternate per round.",
        "vs torch = against torch.distributed.pipelining with the same schedule on gloo.",
        "of ideal = against the bubble-limited ideal: compute-only x m / (m + p - 1).",
        "bubble measured = 1 - (slowest stage's compute-only time) / step time: idle and communication together.",
        "hpdl busy-time bubble = hpdl's own count per stage: 1 - (forward + backward seconds) / step seconds.",
        "peak activations = bytes autograd held for backward at the peak of one step, per stage (ActivationMeter).",
        "max |param diff| = each stage's parameters after the same steps vs hpdl-mpi-1f1b (same trajectory).",
        "single = rank 0 alone on the whole model and batch (no micro-batches); its loss is its own.",
    ]
    if "torch-1f1b" not in contenders_here():
        notes.append(NOT_HERE)
    blocks = [table, "Limits measured in this run:", "\n".join(f"- {line}" for line in limits)]
    text = ("hpdl bench train --strategy pipeline", header, blocks, notes, verdicts)
    harness.write(options, "pipeline", text, records, config, elapsed)


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
        announce=lambda r: f"{r.size} ranks, MPI {r.mpi.engine}, torch {r.gloo.engine}; measuring ...",
    )


if __name__ == "__main__":
    sys.exit(main())
