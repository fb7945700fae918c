"""`hpdl bench torch`: the same unmodified torch code on the "hpdl" backend and on gloo, in one launch.

Contenders alternate within every round, so drift on a shared machine hits
all of them alike:
- DDP (MLP 784-1024-1024-10, batch 64 per rank, and the CNN of `bench train`)
  on hpdl and on gloo, beside hpdl's own `DataParallel`;
- FSDP2 `fully_shard` on the 53.5M-parameter MLP of `bench train --strategy zero`;
- `dist.all_reduce` latency, 4 B .. 64 MiB, on hpdl, on gloo and as a direct
  `Communicator.allreduce` (what the backend adds over hpdl itself).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import numpy as np

from hpdl.bench import report

__all__ = ["main", "launch"]

SIZES = (4, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
LR = 0.01


@dataclass
class Options:
    ranks: int
    quick: bool
    out: str
    rounds: int
    steps: int
    parts: tuple
    timeout: float
    worker: bool

    def forwarded(self) -> list[str]:
        args = ["--worker", f"--out={self.out}", f"--rounds={self.rounds}", f"--steps={self.steps}"]
        args += [f"--parts={','.join(self.parts)}", f"--timeout={self.timeout}"] + (["--quick"] if self.quick else [])
        return args


def parse(argv: Sequence[str]) -> Options:
    p = argparse.ArgumentParser(prog="hpdl bench torch", description=__doc__.split("\n")[0])
    p.add_argument("-n", "--ranks", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="one round, small sizes: a smoke test")
    p.add_argument("--out", default="bench-results/torch")
    p.add_argument("--rounds", type=int, default=0)
    p.add_argument("--steps", type=int, default=0, help="training steps per sample")
    p.add_argument("--parts", default="ddp,fsdp,allreduce", help="comma-separated: ddp, fsdp, allreduce")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args(list(argv))
    parts = tuple(x for x in ns.parts.split(",") if x)
    unknown = set(parts) - {"ddp", "fsdp", "allreduce"}
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; choose from ddp, fsdp, allreduce")
    return Options(
        ranks=ns.ranks,
        quick=ns.quick,
        out=ns.out,
        rounds=ns.rounds or (1 if ns.quick else 5),
        steps=ns.steps or (1 if ns.quick else 5),
        parts=parts,
        timeout=ns.timeout,
        worker=ns.worker,
    )


def launch(argv: list[str]) -> int:
    return report.launch_benchmark("hpdl bench torch", "hpdl.bench.torch_backend", parse, argv)


# --------------------------------------------------------------------------- training
@dataclass
class Contender:
    name: str
    model: Any
    optimizer: Any
    sync: Callable[[], Any]


POOLED = "fsdp2-hpdl-pooled"
"""FSDP2 with `set_allocate_memory_from_process_group_for_comm(True)`: its communication buffers from hpdl's pool."""
CEILING = "no communication (ceiling)"
DDP_ALONE = "DDP, hook without communication"
"""DDP's reducer (bucket copies, autograd hooks, futures) with a comm hook that returns each bucket as it is:
what DDP itself costs on any backend."""


def _without_communication(model: Any) -> Any:
    # (a lambda: DDP checks a hook's annotations against its own classes, and ours are strings)
    model.register_comm_hook(None, lambda state, bucket: _completed(bucket.buffer()))
    return model


def _completed(value: Any) -> Any:
    import torch

    done: Any = torch.futures.Future()
    done.set_result(value)
    return done


def _timed_rounds(contenders: list, run: Callable[[Any], None], rounds: int, world: Any) -> np.ndarray:
    for c in contenders:  # warm-up
        c.sync()
        run(c)
        c.sync()
    times = np.zeros((len(contenders), rounds))
    for r in range(rounds):
        order = np.random.default_rng(r).permutation(len(contenders))
        for i in order:
            c = contenders[i]
            c.sync()
            start = time.perf_counter()
            run(c)
            times[i, r] = time.perf_counter() - start
            c.sync()
    from mpi4py import MPI

    world.mpi_comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)  # a sample lasts until the slowest rank is done
    return times


def _steps(options: Options, batches: list, loss_fn: Callable) -> Callable[[Any], None]:
    def run(c: Contender) -> None:
        for i in range(options.steps):
            x, y = batches[i % len(batches)]
            c.optimizer.zero_grad()
            loss_fn(c.model(x), y).backward()
            c.optimizer.step()

    return run


def measure_ddp(options: Options, world: Any, groups: dict) -> list[dict]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hpdl.bench.train import build_model, make_batches
    from hpdl.parallel import DataParallel

    records = []
    for name in ("mlp",) if options.quick else ("mlp", "cnn"):
        batch = 64 if name == "mlp" else 32

        def fresh(name: str = name) -> Any:
            torch.manual_seed(0)
            return build_model(name)

        contenders = []
        for label, make in (
            ("ddp-hpdl", lambda: DDP(fresh(), process_group=groups["hpdl"])),
            ("ddp-gloo", lambda: DDP(fresh(), process_group=groups["gloo"])),
            ("hpdl DataParallel", lambda: DataParallel(fresh(), world)),
            (CEILING, fresh),  # no gradient exchange at all: the rate no data-parallel backend can beat
            (DDP_ALONE, lambda: _without_communication(DDP(fresh(), process_group=groups["hpdl"]))),
        ):
            model = make()
            sync = (lambda: dist.barrier(group=groups["gloo"])) if label == "ddp-gloo" else world.barrier
            contenders.append(Contender(label, model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), sync))
        batches = make_batches(name, batch, world.rank)
        times = _timed_rounds(contenders, _steps(options, batches, F.cross_entropy), options.rounds, world)
        reference = [p.detach() for p in contenders[1].model.module.parameters()]
        for i, c in enumerate(contenders):
            module = getattr(c.model, "module", c.model)
            diff: Optional[float] = max(
                float((a.detach() - b).abs().max()) for a, b in zip(module.parameters(), reference)
            )
            if c.name in (CEILING, DDP_ALONE):
                diff = None  # each rank trained on its own batches only
            samples = [batch * world.size * options.steps / t for t in times[i]]
            stats = report.summarize(samples)
            records.append({"part": "ddp", "model": name, "contender": c.name, "samples_per_s": stats,
                            "max_param_diff_vs_ddp_gloo": diff})  # fmt: skip
    return records


def measure_fsdp(options: Options, world: Any, groups: dict) -> list[dict]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from hpdl.bench.train_zero import MODELS, build_model

    name = "mlp" if options.quick else "mlp50m"
    batch = MODELS[name][1]
    contenders = []
    pooling = hasattr(FSDPModule, "set_allocate_memory_from_process_group_for_comm")  # (torch >= 2.8)
    for label in ("fsdp2-hpdl", POOLED, "fsdp2-gloo") if pooling else ("fsdp2-hpdl", "fsdp2-gloo"):
        mesh = DeviceMesh.from_group(groups[label.split("-")[1]], "cpu")
        model = build_model(name)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if label == POOLED:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_allocate_memory_from_process_group_for_comm(True)
        sync = (lambda: dist.barrier(group=groups["gloo"])) if label == "fsdp2-gloo" else world.barrier
        contenders.append(Contender(label, model, torch.optim.Adam(model.parameters(), lr=1e-3), sync))
    gen = torch.Generator().manual_seed(world.rank)
    batches = [(torch.randn(batch, 784, generator=gen), torch.randint(0, 10, (batch,), generator=gen))]
    times = _timed_rounds(contenders, _steps(options, batches, F.cross_entropy), options.rounds, world)
    peaks = _step_peaks(contenders, _steps(replace(options, steps=1), batches, F.cross_entropy), world)
    records = []
    for i, c in enumerate(contenders):
        samples = [batch * world.size * options.steps / t for t in times[i]]
        records.append({"part": "fsdp", "model": name, "contender": c.name, "samples_per_s": report.summarize(samples),
                        "step_peak_rss_bytes": peaks[i]})  # fmt: skip
    return records


def _step_peaks(contenders: list, run: Callable[[Any], None], world: Any) -> list[Optional[int]]:
    """Per contender, what one training step adds to the resident set at its peak (the largest of two probes, in
    alternating order, on the rank where it is largest); None where Linux's high-water mark cannot be reset. For
    the pooled contender, the buffers hpdl's pool holds at the step's start count as the step's, and so do the
    bytes by which buffers still in use (gradients) exceed what their requests asked: without the pool they would
    be free."""
    from mpi4py import MPI

    from hpdl.bench import resident
    from hpdl.interop.torch_backend.buffer_pool import pool

    peaks = np.zeros(len(contenders))
    for _ in range(2):
        for i, c in enumerate(contenders):
            c.sync()
            held = pool.held_bytes + pool.lent_beyond_bytes if c.name == POOLED else 0
            peak = resident.peak_increase(functools.partial(run, c))
            peaks[i] = max(peaks[i], -1.0 if peak is None else float(peak + held))
            c.sync()
    world.mpi_comm.Allreduce(MPI.IN_PLACE, peaks, op=MPI.MAX)
    return [None if p < 0 else int(p) for p in peaks]


def measure_allreduce(options: Options, world: Any, groups: dict) -> list[dict]:
    import torch
    import torch.distributed as dist

    records = []
    sizes = SIZES[:4] if options.quick else SIZES
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        tensors = {k: torch.ones(n) for k in ("hpdl backend", "direct Communicator", "gloo")}
        own, direct, gloo = tensors["hpdl backend"], tensors["direct Communicator"], tensors["gloo"]
        calls = {
            "hpdl backend": lambda t=own: dist.all_reduce(t, group=groups["hpdl"]),
            "direct Communicator": lambda t=direct: world.allreduce(t),
            "gloo": lambda t=gloo: dist.all_reduce(t, group=groups["gloo"]),
        }
        iters = max(2, min(200, int(2e7 // max(nbytes, 1 << 14))))
        if options.quick:
            iters = min(iters, 5)
        samples: dict[str, list] = {k: [] for k in calls}
        for fn in calls.values():
            fn()
        for r in range(max(3, options.rounds)):
            for key in np.random.default_rng(r).permutation(list(calls)):
                world.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    calls[key]()
                samples[key].append((time.perf_counter() - start) / iters)
        for key, values in samples.items():
            arr = np.array(values)
            world.mpi_comm.Allreduce(__import__("mpi4py").MPI.IN_PLACE, arr, op=__import__("mpi4py").MPI.MAX)
            records.append({"part": "allreduce", "bytes": nbytes, "contender": key,
                            "latency_s": report.summarize(list(arr))})  # fmt: skip
    return records


# --------------------------------------------------------------------------- report
def _rate(stats: dict) -> str:
    return f"{stats['median']:.0f} [{stats['min']:.0f}-{stats['max']:.0f}]"


def _us(stats: dict) -> str:
    return f"{stats['median'] * 1e6:.0f} [{stats['min'] * 1e6:.0f}-{stats['max'] * 1e6:.0f}]"


def write(options: Options, records: list[dict], config: dict, elapsed: float) -> None:
    blocks, targets = [], []
    train = [r for r in records if r["part"] in ("ddp", "fsdp")]
    if train:
        rows = []
        for part, model in dict.fromkeys((r["part"], r["model"]) for r in train):
            mine = {r["contender"]: r for r in train if (r["part"], r["model"]) == (part, model)}
            med = {k: v["samples_per_s"]["median"] for k, v in mine.items()}
            for name, r in mine.items():
                ratio_gloo = med[name] / med.get(f"{part}2-gloo" if part == "fsdp" else "ddp-gloo", med[name])
                diff, peak = r.get("max_param_diff_vs_ddp_gloo"), r.get("step_peak_rss_bytes")
                rows.append([part, model, name, _rate(r["samples_per_s"]), f"{ratio_gloo:.2f}x",
                             "" if diff is None else f"{diff:.1e}",
                             "" if peak is None else f"{peak / 2**20:.0f}"])  # fmt: skip
            if part == "ddp":
                targets.append(f"{report.verdict(med['ddp-hpdl'] >= 1.2 * med['ddp-gloo'])} {model}: DDP on hpdl "
                               f"{med['ddp-hpdl'] / med['ddp-gloo']:.2f}x gloo (target >= 1.2x)")  # fmt: skip
                ratio = med["ddp-hpdl"] / med["hpdl DataParallel"]
                targets.append(f"{report.verdict(ratio >= 0.95)} {model}: DDP on hpdl {ratio:.2f}x hpdl DataParallel "
                               "(target within 5%)")  # fmt: skip
                targets.append(f"INFO {model}: training without any communication runs at "
                               f"{med[CEILING] / med['ddp-gloo']:.2f}x gloo: the most any backend could reach "
                               "in this run")  # fmt: skip
                if DDP_ALONE in med:
                    targets.append(f"INFO {model}: DDP with a comm hook that communicates nothing runs at "
                                   f"{med[DDP_ALONE] / med['hpdl DataParallel']:.2f}x hpdl DataParallel: the most "
                                   "DDP on any backend could reach in this run")  # fmt: skip
            else:
                theirs = mine["fsdp2-gloo"].get("step_peak_rss_bytes")
                for name, how in (("fsdp2-hpdl", ""), (POOLED, " with its buffers from the group's pool")):
                    if name not in med:
                        continue
                    ratio = med[name] / med["fsdp2-gloo"]
                    targets.append(f"{report.verdict(ratio >= 2.0)} {model}: FSDP2 on hpdl{how} {ratio:.2f}x gloo "
                                   "(target >= 2x)")  # fmt: skip
                    ours = mine[name].get("step_peak_rss_bytes")
                    if ours is not None and theirs is not None:
                        targets.append(f"{report.verdict(ours <= 1.05 * theirs)} {model}: FSDP2 step's peak RSS on "
                                       f"hpdl{how} {ours / 2**20:.0f} MiB, on gloo {theirs / 2**20:.0f} MiB (target: "
                                       "no higher, 5% allowed)")  # fmt: skip
        headers = ["part", "model", "contender", "samples/s median [min-max]", "vs gloo", "max |param diff| vs gloo",
                   "step's peak RSS increase (MiB)"]  # fmt: skip
        blocks.append(report.markdown_table(headers, rows, right_align_from=3))
    lat = [r for r in records if r["part"] == "allreduce"]
    if lat:
        rows = []
        for nbytes in dict.fromkeys(r["bytes"] for r in lat):
            mine = {r["contender"]: r["latency_s"] for r in lat if r["bytes"] == nbytes}
            backend, direct, gloo = (mine[k]["median"] for k in ("hpdl backend", "direct Communicator", "gloo"))
            rows.append([report.format_bytes(nbytes), _us(mine["hpdl backend"]), _us(mine["direct Communicator"]),
                         _us(mine["gloo"]), f"{backend / direct:.2f}x", f"{backend / gloo:.2f}x"])  # fmt: skip
            targets.append(f"{report.verdict(backend <= 1.3 * direct)} {report.format_bytes(nbytes)}: backend "
                           f"{backend / direct:.2f}x direct (target <= 1.3x)")  # fmt: skip
            if nbytes >= 1 << 20:
                targets.append(f"{report.verdict(backend <= 0.7 * gloo)} {report.format_bytes(nbytes)}: backend "
                               f"{backend / gloo:.2f}x gloo (target <= 0.7x)")  # fmt: skip
        headers = ["size", "dist.all_reduce on hpdl (µs)", "direct Communicator (µs)", "gloo (µs)", "hpdl / direct",
                   "hpdl / gloo"]  # fmt: skip
        blocks.append(report.markdown_table(headers, rows))
    thp = config.get("transparent_hugepage") or {}
    header = (
        f"{config['world_ranks']} ranks, {options.rounds} rounds, contenders alternating in a new order each round. "
        f"THP_MEM_ALLOC_ENABLE={config.get('thp_mem_alloc_enable')} (torch's large CPU tensors on huge pages; "
        f"kernel: enabled {thp.get('enabled')}, defrag {thp.get('defrag')}): it moves FSDP2's rates, gloo's most "
        "(docs/torch_backend.md)."
    )
    notes = ["samples/s = global batch x steps / sample time (slowest rank); latency = median [min-max] over rounds.",
             "ddp-hpdl and ddp-gloo run the same unmodified DDP code; only the process group differs.",
             "step's peak RSS increase: what one FSDP2 step adds to the resident set at its peak (Linux VmHWM, reset "
             "before the step; the largest of two probes and of the ranks); for fsdp2-hpdl-pooled (FSDP2 takes its "
             "communication buffers from the group: set_allocate_memory_from_process_group_for_comm) with what the "
             "pool holds at the step's start and what lent buffers in use keep beyond their requests."]  # fmt: skip
    text = report.markdown_document("hpdl bench torch", header, blocks, notes, targets)
    report.write_report(options.out, "torch", text, records, config, elapsed)


def main(argv: Optional[list[str]] = None) -> int:
    return report.run_main(argv, parse, launch, worker)


def worker(options: Options) -> int:
    import torch
    import torch.distributed as dist

    import hpdl

    started = time.perf_counter()
    torch.set_num_threads(1)
    world = hpdl.init("mpi", timeout=options.timeout, debug=False)
    dist.init_process_group("hpdl")
    groups = {"hpdl": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    records: list[dict] = []
    for part, measure in (("ddp", measure_ddp), ("fsdp", measure_fsdp), ("allreduce", measure_allreduce)):
        if part in options.parts:
            if world.rank == 0:
                print(f"hpdl bench torch: {part} ...", flush=True)
            records += measure(options, world, groups)
    if world.rank == 0:
        config = report.environment(benchmark="torch", world_ranks=world.size, rounds=options.rounds,
                                    steps=options.steps, mpi_engine=world.engine)  # fmt: skip
        write(options, records, config, time.perf_counter() - started)
    world.barrier()
    dist.destroy_process_group()
    hpdl.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
