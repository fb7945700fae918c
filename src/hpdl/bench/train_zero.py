"""`hpdl bench train --strategy zero`: ZeRO stages 1/2/3 beside PyTorch FSDP2, ZeroRedundancyOptimizer and DeepSpeed.

Contenders, on the same ranks, data, initial model and optimizer (AdamW),
alternating per round so that drift on a shared machine hits them alike:

    hpdl-z{1,2,3}-mpi    hpdl.parallel.zero(stage=1/2/3) over hpdl.init("mpi")
    hpdl-z{1,2,3}-gloo   the same over hpdl.init("torch") (gloo)
    hpdl-dp-mpi          hpdl.parallel.DataParallel + torch.optim.AdamW (no sharding: the reference)
    fsdp2-gloo           torch.distributed.fsdp.fully_shard per Linear and on the root (FSDP2), gloo
    zero-redundancy-gloo DistributedDataParallel + torch.distributed.optim.ZeroRedundancyOptimizer, gloo
    deepspeed-z{2,3}     deepspeed.initialize with ZeRO-2/3 on gloo (DS_ACCELERATOR=cpu), where importable

A step is the whole step (forward, loss, backward with its communication,
optimizer); synthetic data in memory. Weak scaling: the per-rank batch is
fixed. Model-state memory is measured in a separate phase, one contender at
a time: the bytes of every storage of a live tensor object (parameters,
gradients, optimizer state, gathered units; not RSS), above what existed
before the contender was built, sampled after every layer's forward, after
backward and after the step; the peak is reported beside the ZeRO formula.
The hpdl contenders use plain MPI (no shared-memory staging buffers) in that
phase, so the count is model state only.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from hpdl.bench import report
from hpdl.bench.comm import _positive, run_worker

__all__ = ["launch", "main", "CONTENDERS"]

HPDL = tuple(f"hpdl-z{s}-{b}" for b in ("mpi", "gloo") for s in (1, 2, 3))
CONTENDERS = (*HPDL, "hpdl-dp-mpi", "fsdp2-gloo", "zero-redundancy-gloo", "deepspeed-z2", "deepspeed-z3")
MODELS = {"mlp50m": ((784, 4096, 4096, 4096, 4096, 10), 16), "mlp": ((784, 1024, 1024, 10), 64)}
"""Model name -> (layer widths, per-rank batch). mlp50m has 53.5 M parameters; mlp is the dp benchmark's."""
LR = 1e-3
TARGETS = [
    ("hpdl-z3-mpi", "fsdp2-gloo", "samples/s", 1.5),
    ("hpdl-z3-mpi", "fsdp2-gloo", "memory", 1.0),
    ("hpdl-z2-mpi", "deepspeed-z2", "samples/s", 1.5),
    ("hpdl-z1-mpi", "hpdl-dp-mpi", "samples/s", 0.9),
    ("hpdl-z2-mpi", "hpdl-dp-mpi", "samples/s", 0.9),
]
"""(contender, peer, what, ratio): samples/s at least ratio x the peer's; memory at most ratio x the peer's."""


@dataclass(frozen=True)
class Options:
    ranks: int = 2
    quick: bool = False
    out: str = "bench-results/train-zero"
    models: tuple[str, ...] = ("mlp50m", "mlp")
    rounds: int = 7
    steps: int = 5
    warmup: int = 2
    bucket_mb: float = 25.0
    timeout: float = 3600.0
    worker: bool = False
    contenders: tuple[str, ...] = CONTENDERS

    def forwarded(self) -> list[str]:
        args = ["--strategy", "zero", "--worker", "--out", os.path.abspath(self.out), "-n", str(self.ranks)]
        args += ["--rounds", str(self.rounds), "--steps", str(self.steps), "--bucket-mb", str(self.bucket_mb)]
        args += ["--models", *self.models, "--contenders", *self.contenders]
        return args + (["--quick"] if self.quick else [])


def parse(argv: Sequence[str]) -> Options:
    parser = argparse.ArgumentParser(
        prog="hpdl bench train --strategy zero",
        description="Samples/s and per-rank model-state memory of hpdl ZeRO stages 1/2/3 (MPI, gloo) beside "
        "FSDP2, ZeroRedundancyOptimizer, DeepSpeed and DataParallel, alternating in one launch.",
    )
    parser.add_argument("--strategy", default="zero", choices=["zero"])
    parser.add_argument("-n", "--ranks", type=_positive(int), default=2, help="MPI processes (default 2)")
    parser.add_argument("--quick", action="store_true", help="the small MLP, 1 round of 1 step (a smoke test)")
    parser.add_argument("--out", default="bench-results/train-zero", help="output folder")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), help="models (default: mlp50m mlp)")
    parser.add_argument("--rounds", type=_positive(int), help="timed rounds (default 7)")
    parser.add_argument("--steps", type=_positive(int), help="steps per timed sample (default 5)")
    parser.add_argument("--bucket-mb", type=_positive(float), default=25.0, help="hpdl unit size (default 25)")
    parser.add_argument("--timeout", type=_positive(float), default=3600.0, help="stop the job after this many s")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, help="a subset (default: all)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args(list(argv))
    if ns.ranks < 2:
        parser.error(f"-n {ns.ranks}: sharding needs at least 2 ranks")
    quick = bool(ns.quick)
    return Options(
        ranks=ns.ranks,
        quick=quick,
        out=ns.out,
        models=tuple(ns.models or (("mlp",) if quick else ("mlp50m", "mlp"))),
        rounds=ns.rounds or (1 if quick else 7),
        steps=ns.steps or (1 if quick else 5),
        warmup=1 if quick else 2,
        bucket_mb=ns.bucket_mb,
        timeout=ns.timeout,
        worker=bool(ns.worker),
        contenders=tuple(ns.contenders or CONTENDERS),
    )


def launch(argv: list[str]) -> int:
    """Start the benchmark on its ranks and return its exit code (2 for bad arguments)."""

    def start(options: Options) -> int:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        name = "hpdl bench train --strategy zero"
        return run_worker(name, "hpdl.bench.train_zero", options.ranks, options.forwarded(), options.timeout)

    return report.launch_parsed(parse, argv, start)


# --------------------------------------------------------------------------- models and contenders
def build_model(name: str) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    widths = MODELS[name][0]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


@dataclass
class Contender:
    name: str
    model: Any
    optimizer: Any
    sync: Callable[[], Any]
    backward: Optional[Callable[[Any], None]] = None
    """DeepSpeed's engine.backward(loss); others use loss.backward()."""
    step: Optional[Callable[[], None]] = None
    last_loss: float = float("nan")
    steps_done: int = 0


def deepspeed_available() -> Optional[str]:
    """None when `import deepspeed` works, else why not."""
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # any failure: ImportError, a missing accelerator, a compiler problem
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:160]
    return None


def build(name: str, model_name: str, mpi: Any, gloo: Any, bucket_mb: float, plain_mpi: Any = None) -> Contender:
    """One contender, ready to step; raises if the peer cannot run here (reported, not fatal)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import hpdl

    model = build_model(model_name)
    gloo_sync = dist.barrier

    def mpi_sync() -> None:
        mpi.barrier()

    if name.startswith("hpdl-z"):
        stage = int(name[6])
        comm = gloo if name.endswith("gloo") else (plain_mpi or mpi)
        zmodel, zopt = hpdl.parallel.zero(
            model, comm, stage=stage, optimizer=torch.optim.AdamW, lr=LR, bucket_mb=bucket_mb, wrap_policy=(nn.Linear,)
        )
        return Contender(name, zmodel, zopt, gloo_sync if name.endswith("gloo") else mpi_sync)
    if name == "hpdl-dp-mpi":
        dp = hpdl.parallel.DataParallel(model, plain_mpi or mpi, bucket_mb=bucket_mb)
        return Contender(name, dp, torch.optim.AdamW(dp.parameters(), lr=LR), mpi_sync)
    if name == "fsdp2-gloo":
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        return Contender(name, model, torch.optim.AdamW(model.parameters(), lr=LR), gloo_sync)
    if name == "zero-redundancy-gloo":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
        return Contender(name, ddp, opt, gloo_sync)
    if name.startswith("deepspeed"):
        problem = deepspeed_available()
        if problem is not None:
            raise RuntimeError(f"deepspeed not importable ({problem})")
        import deepspeed

        # DeepSpeed reads the launcher's variables even when torch.distributed is already initialised
        os.environ.setdefault("LOCAL_RANK", str(gloo.local_rank))
        os.environ.setdefault("RANK", str(gloo.rank))
        os.environ.setdefault("WORLD_SIZE", str(gloo.size))
        elements = int(bucket_mb * 1024 * 1024 / 4)  # the same bucket size as hpdl's units (DeepSpeed counts elements)
        config = {
            "train_micro_batch_size_per_gpu": MODELS[model_name][1],
            "zero_optimization": {
                "stage": int(name[-1]),
                "reduce_bucket_size": elements,
                "allgather_bucket_size": elements,
                "stage3_prefetch_bucket_size": elements,
            },
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        engine, opt, _, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), config=config
        )
        return Contender(name, engine, opt, gloo_sync, backward=engine.backward, step=engine.step)
    raise ValueError(f"unknown contender {name}")


def make_batches(model_name: str, rank: int, count: int = 4) -> list:
    import torch

    widths, batch = MODELS[model_name]
    g = torch.Generator().manual_seed(1000 + rank)
    return [
        (torch.randn(batch, widths[0], generator=g), torch.randint(0, widths[-1], (batch,), generator=g))
        for _ in range(count)
    ]


def run_steps(c: Contender, batches: list, steps: int, probe: Optional[Callable[[], None]] = None) -> None:
    import torch.nn.functional as F

    for _ in range(steps):
        x, y = batches[c.steps_done % len(batches)]
        if c.step is None:
            c.optimizer.zero_grad()
        loss = F.cross_entropy(c.model(x), y)
        if c.backward is not None:
            c.backward(loss)
        else:
            loss.backward()
        if probe is not None:
            probe()
        if c.step is not None:
            c.step()
        else:
            c.optimizer.step()
        if probe is not None:
            probe()
        c.steps_done += 1
    c.last_loss = float(loss.detach())


# --------------------------------------------------------------------------- memory phase
def live_bytes() -> dict[int, int]:
    """data_ptr -> bytes of every storage of a live tensor object (CPU)."""
    import torch

    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
                if storage.device.type != "meta" and storage.nbytes():
                    out[storage.data_ptr()] = storage.nbytes()
            except Exception:  # wrapper subclasses (DTensor) hold their data in a local tensor, counted itself
                continue
    return out


def measure_memory(name: str, model_name: str, mpi: Any, gloo: Any, plain_mpi: Any, bucket_mb: float) -> dict:
    from torch import nn

    batches = make_batches(model_name, mpi.rank, 1)
    gc.collect()
    before = live_bytes()
    peak = [0]

    active = [False]

    def probe(*_: Any) -> None:
        if not active[0]:
            return
        now = live_bytes()
        peak[0] = max(peak[0], sum(b for ptr, b in now.items() if ptr not in before))

    try:
        c = build(name, model_name, mpi, gloo, bucket_mb, plain_mpi)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    module = c.model
    while hasattr(module, "module") and isinstance(module.module, nn.Module):
        module = module.module
    hooks = [m.register_forward_hook(probe, prepend=True) for m in module.modules() if isinstance(m, nn.Linear)]
    try:
        run_steps(c, batches, 1)  # the first step allocates the optimizer state
        active[0] = True  # sample the second: every buffer a step uses exists
        run_steps(c, batches, 1, probe)
    finally:
        for h in hooks:
            h.remove()
    del c
    gc.collect()
    return {"peak_model_state_bytes": peak[0]}


# --------------------------------------------------------------------------- timing phase
def measure_model(model_name: str, options: Options, mpi: Any, gloo: Any, plain_mpi: Any) -> list[dict[str, Any]]:
    import torch

    # Objects alive before the memory phase (torch's own, hundreds of thousands) are frozen out of the scans
    # every Linear's probe makes: gc.get_objects leaves them out, and none of them is a contender's state.
    gc.collect()
    gc.freeze()
    try:
        memory = {n: measure_memory(n, model_name, mpi, gloo, plain_mpi, options.bucket_mb) for n in options.contenders}
    finally:
        gc.unfreeze()
    batches = make_batches(model_name, mpi.rank)
    contenders: list[Contender] = []
    errors: dict[str, str] = {n: m["error"] for n, m in memory.items() if "error" in m}
    for n in options.contenders:
        if n in errors:
            continue
        try:
            contenders.append(build(n, model_name, mpi, gloo, options.bucket_mb))
        except Exception as exc:
            errors[n] = f"{type(exc).__name__}: {exc}"[:200]
    for c in contenders:
        c.sync()
        run_steps(c, batches, options.warmup)
        c.sync()
    times = np.zeros((len(contenders), options.rounds))
    for r in range(options.rounds):
        for i, c in enumerate(contenders):
            c.sync()
            start = time.perf_counter()
            run_steps(c, batches, options.steps)
            times[i, r] = time.perf_counter() - start
            c.sync()
    from mpi4py import MPI

    mpi.mpi_comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)  # a sample lasts until its slowest rank finishes
    batch = MODELS[model_name][1]
    numel = sum(p.numel() for p in build_model(model_name).parameters())
    records = []
    for i, c in enumerate(contenders):
        samples = [batch * mpi.size * options.steps / t for t in times[i]]
        records.append(
            {
                "model": model_name,
                "contender": c.name,
                "ranks": mpi.size,
                "params": numel,
                "batch_per_rank": batch,
                "global_batch": batch * mpi.size,
                "steps_per_sample": options.steps,
                "samples_per_s": report.summarize(samples),
                "step_ms": float(np.median(times[i])) / options.steps * 1e3,
                "loss": c.last_loss,
                "peak_model_state_bytes": memory[c.name].get("peak_model_state_bytes"),
                "dtype": str(torch.get_default_dtype()).replace("torch.", ""),
            }
        )
    for name, error in errors.items():
        records.append({"model": model_name, "contender": name, "ranks": mpi.size, "params": numel, "error": error})
    return records


# --------------------------------------------------------------------------- report
def analyse(records: list[dict[str, Any]]) -> tuple[list[list[Any]], list[str]]:
    from hpdl.parallel.zero_redundancy import memory_formula

    rows, verdicts = [], []
    for model in dict.fromkeys(r["model"] for r in records):
        mine = {r["contender"]: r for r in records if r["model"] == model and "error" not in r}
        dp = mine.get("hpdl-dp-mpi")
        for r in records:
            if r["model"] != model:
                continue
            if "error" in r:
                rows.append([model, r["contender"], None, "-", None, None, None, None, r["error"]])
                continue
            s = r["samples_per_s"]
            formula = None
            if r["contender"].startswith("hpdl-z"):
                stage = int(r["contender"][6])
                gathered = gathered_bytes(model) if stage == 3 else 0
                formula = memory_formula(stage, r["params"], r["ranks"], gathered_bytes=gathered)["total"]
            elif r["contender"] == "hpdl-dp-mpi":
                formula = memory_formula(0, r["params"], r["ranks"])["total"]
            r["formula_bytes"] = formula
            r["vs_dp"] = s["median"] / dp["samples_per_s"]["median"] if dp else None
            mem = r["peak_model_state_bytes"]
            rows.append(
                [
                    model,
                    r["contender"],
                    s["median"],
                    f"{s['min']:.0f}-{s['max']:.0f}",
                    r["vs_dp"],
                    report.format_bytes(mem) if mem else None,
                    report.format_bytes(int(formula)) if formula else None,
                    r["loss"],
                    "",
                ]
            )
        for contender, peer, what, ratio in TARGETS:
            a, b = mine.get(contender), mine.get(peer)
            if a is None or b is None:
                verdicts.append(f"N/A {model}: {contender} vs {peer} ({what}): one of them did not run")
                continue
            if what == "memory":
                got = a["peak_model_state_bytes"] / b["peak_model_state_bytes"]
                verdicts.append(
                    f"{report.verdict(got <= ratio)} {model}: {contender} peak model state {got:.2f}x "
                    f"{peer}'s (target <= {ratio}x)"
                )
            else:
                got = a["samples_per_s"]["median"] / b["samples_per_s"]["median"]
                verdicts.append(
                    f"{report.verdict(got >= ratio)} {model}: {contender} {got:.2f}x {peer}'s samples/s "
                    f"(target >= {ratio}x)"
                )
    return rows, verdicts


def gathered_bytes(model_name: str) -> int:
    """Stage 3 with one unit per Linear: in backward, a unit and the prefetched one before it are gathered."""
    widths = MODELS[model_name][0]
    units = [(a + 1) * b for a, b in zip(widths[:-1], widths[1:])]
    return 4 * max(x + y for x, y in zip(units, units[1:] or [0]))


HEADERS = [
    "model",
    "contender",
    "samples/s (median)",
    "min-max",
    "vs hpdl-dp",
    "peak model state / rank",
    "ZeRO formula",
    "loss",
    "note",
]


def write_report(options: Options, records: list[dict[str, Any]], config: dict[str, Any], elapsed: float) -> None:
    rows, verdicts = analyse(records)
    table = report.markdown_table(HEADERS, rows, right_align_from=2)
    header = (
        f"hpdl bench train --strategy zero: {options.ranks} ranks, OMP_NUM_THREADS=1, MPI {config['mpi_engine']}, "
        f"torch {config['torch_version']}, deepspeed {config['deepspeed']}, unit/bucket {options.bucket_mb} MB, "
        f"{options.rounds} rounds x {options.steps} steps, AdamW lr {LR}, float32, weak scaling "
        + ", ".join(f"{m} {'-'.join(map(str, MODELS[m][0]))} batch {MODELS[m][1]}/rank" for m in options.models)
    )
    notes = [
        "samples/s = global batch x steps / sample time (slowest rank); min-max over rounds.",
        "peak model state = the largest sum of storages of live tensor objects above the pre-build baseline, "
        "sampled after every Linear's forward, after backward and after the step (parameters, gradients, "
        "optimizer state, gathered units; autograd's saved activations mostly not visible). Not RSS.",
        "ZeRO formula (fp32, Adam): stage 1 8Psi+8Psi/N, stage 2 4Psi+12Psi/N, stage 3 16Psi/N + the two largest "
        "neighbouring units (a unit and its prefetched neighbour in backward).",
        "hpdl stage 3 units: one per Linear (wrap_policy=(nn.Linear,)); FSDP2: fully_shard per Linear and root.",
    ]
    text = report.markdown_document("hpdl bench train --strategy zero", header, [table], notes, verdicts)
    report.write_report(options.out, "train_zero", text, records, config, elapsed)


def main(argv: Optional[list[str]] = None) -> int:
    """`launch` by default; with --worker, `worker` (every rank)."""
    return report.run_main(argv, parse, launch, worker)


def worker(options: Options) -> int:
    """The worker (every rank): MPI and gloo communicators in one process, every contender, report on rank 0."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    import hpdl

    started = time.perf_counter()
    mpi, gloo = report.worker_communicators(600.0)
    plain_mpi: Any = mpi.split(0, mpi.rank)  # the memory phase: no shared-memory staging buffers in the count
    plain_mpi.shared_memory = False
    if mpi.rank == 0:
        print(f"hpdl bench train --strategy zero: {mpi.size} ranks, MPI {mpi.engine}, measuring ...", flush=True)
    records = []
    for name in options.models:
        records += measure_model(name, options, mpi, gloo, plain_mpi)
    if mpi.rank == 0:
        ds_problem = deepspeed_available()
        ds_version = "not importable"
        if ds_problem is None:
            import deepspeed

            ds_version = deepspeed.__version__
        config = report.environment(
            benchmark="train-zero",
            strategy="zero",
            quick=options.quick,
            world_ranks=mpi.size,
            rounds=options.rounds,
            bucket_mb=options.bucket_mb,
            mpi_engine=mpi.engine,
            gloo_engine=gloo.engine,
            optimizer=f"AdamW(lr={LR})",
            deepspeed=ds_version,
        )
        write_report(options, records, config, time.perf_counter() - started)
    mpi.barrier()
    hpdl.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
