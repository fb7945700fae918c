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

A second part (its own launch on 4 ranks, after the first; `--part composed`)
puts ZeRO-3 inside dp2 x pp2 and dp2 x tp2 beside ZeRO-2 in the same layout
(train_zero_composed.py). It lives here, not in the hybrid bench, because it
answers this bench's question (what ZeRO-3 costs and saves against its peers)
with the same measurements: alternating rounds and the peak model state.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from hpdl.bench import report
from hpdl.bench import strategy_harness as harness
from hpdl.bench import train_zero_composed as composed
from hpdl.bench.arguments import positive
from hpdl.bench.live_tensors import live_bytes
from hpdl.bench.strategy_harness import Options, Ranks

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


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), help="MLP part: models (default: mlp50m mlp)")
    parser.add_argument("--bucket-mb", type=positive(float), default=25.0, help="MLP part: hpdl unit size (default 25)")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, help="MLP part: a subset (default: all)")
    parser.add_argument(
        "--layouts", nargs="+", choices=list(composed.COMPOSED), help="composed part: a subset (default: all)"
    )
    parser.add_argument(
        "--part",
        choices=["all", "mlp", "composed"],
        default="all",
        help="mlp: the MLPs on -n ranks; composed: ZeRO-3 in dp2 x pp2 and dp2 x tp2 on 4 ranks; all: both",
    )


def _check(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    if ns.ranks < 2:
        parser.error(f"-n {ns.ranks}: sharding needs at least 2 ranks")
    return {
        "models": tuple(ns.models or (("mlp",) if ns.quick else ("mlp50m", "mlp"))),
        "bucket_mb": ns.bucket_mb,
        "contenders": tuple(ns.contenders or CONTENDERS),
        "layouts": tuple(ns.layouts or composed.COMPOSED),
        "part": ns.part,
    }


BENCH = harness.Bench(
    strategy="zero",
    module="hpdl.bench.train_zero",
    description="Samples/s and per-rank model-state memory of hpdl ZeRO stages 1/2/3 (MPI, gloo) beside "
    "FSDP2, ZeroRedundancyOptimizer, DeepSpeed and DataParallel, alternating in one launch; then ZeRO-3 in "
    "dp2 x pp2 and dp2 x tp2 beside ZeRO-2 in the same layouts, on 4 ranks.",
    out="bench-results/train-zero",
    rounds=(7, 1),
    steps=(5, 1),
    warmup=(2, 1),
    timeout=3600.0,
    ranks_help="ranks of the MLP part (the composed part runs on 4)",
    quick_help="the small MLP and a tiny GPT, 1 round of 1 step (a smoke test)",
    options=_options,
    check=_check,
)


def parse(argv: list[str]) -> Options:
    return harness.parse(BENCH, argv)


def launch(argv: list[str]) -> int:
    """Start the benchmark on its ranks and return its exit code (2 for bad arguments)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's ranks: the CPU accelerator
    return harness.launch(BENCH, argv, _run_parts)


def _run_parts(options: Options) -> int:
    """The MLPs on -n ranks, then ZeRO-3 composed with pp and tp on 4 (each its own mpiexec); the first failure."""
    for part, ranks in (("mlp", options.ranks), ("composed", composed.RANKS)):
        if options.part in ("all", part):
            forwarded = options.forwarded("--part", part)
            code = report.run_worker(BENCH.prog, BENCH.module, ranks, forwarded, options.timeout)
            if code:
                return code
    return 0


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
    times = harness.alternate(
        len(contenders),
        options.rounds,
        lambda i: run_steps(contenders[i], batches, options.steps),
        lambda i: contenders[i].sync(),
        mpi,
    )
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
                absent = " and ".join(n for n, r in ((contender, a), (peer, b)) if r is None)
                verdicts.append(f"n/a {model}: {contender} vs {peer} ({what}): no {absent} in this run")
                continue
            if what == "memory":
                got = a["peak_model_state_bytes"] / b["peak_model_state_bytes"]
                verdicts.append(
                    f"{report.verdict(got <= ratio)} {model}: {contender} peak model state {got:.2f}x "
                    f"{peer}'s (target <= {ratio}x)"
                )
            else:
                got = a["samples_per_s"]["median"] / b["samples_per_s"]["median"]
                verdicts.append(harness.faster(f"{model}: {contender}", got, f"{peer}'s samples/s", ratio))
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


def write_report(ranks: Ranks, options: Options, records: list[dict[str, Any]], elapsed: float) -> None:
    rows, verdicts = analyse(records)
    table = report.markdown_table(HEADERS, rows, right_align_from=2)
    ds_version = "not importable"
    if deepspeed_available() is None:
        import deepspeed

        ds_version = deepspeed.__version__
    config = harness.config(
        options, ranks, "train-zero", bucket_mb=options.bucket_mb, optimizer=f"AdamW(lr={LR})", deepspeed=ds_version
    )
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
    text = ("hpdl bench train --strategy zero", header, [table], notes, verdicts)
    harness.write(options, "train_zero", text, records, config, elapsed)


def main(argv: Optional[list[str]] = None) -> int:
    """`launch` by default; with --worker, `worker` (every rank)."""
    return harness.main(BENCH, launch, worker, argv)


def worker(options: Options) -> int:
    """The worker (every rank): MPI and gloo communicators in one process, every contender, report on rank 0;
    the composed part's on its 4 ranks (MPI only)."""
    if options.part == "composed":
        return composed.run(options)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    def measure(ranks: Ranks) -> list[dict[str, Any]]:
        plain_mpi: Any = ranks.mpi.split(0, ranks.rank)  # the memory phase: no shared-memory staging buffers
        plain_mpi.shared_memory = False
        return [r for name in options.models for r in measure_model(name, options, ranks.mpi, ranks.gloo, plain_mpi)]

    return harness.worker(
        measure,
        lambda ranks, records, elapsed: write_report(ranks, options, records, elapsed),
        timeout=600.0,
        announce=lambda r: f"hpdl bench train --strategy zero: {r.size} ranks, MPI {r.mpi.engine}, measuring ...",
    )


if __name__ == "__main__":
    sys.exit(main())
