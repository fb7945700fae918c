"""`hpdl bench train --strategy hybrid`: every dp x pp x tp mesh of 4 ranks on a small GPT, and tp=2 against
`torch.distributed.tensor.parallel`.

Part 1 (`-n 4` MPI ranks): each mesh (dp4, pp4, tp4, dp2xpp2, dp2xtp2,
pp2xtp2, plus ZeRO-1/2 variants) trains the same GPT from the same initial
weights on the same data with AdamW; per mesh: samples/s (median and spread
over rounds), model-state bytes per rank (parameters, gradients, optimizer
state, counted from tensor storages), and the bytes each rank hands to the
communicator per step, split by mesh axis (tp, dp, pp), next to the
analytical volume (Megatron-LM: 4 allreduces of b*s*h per transformer
layer per step for tp, plus the embedding, head and loss; one gradient
reduction per step for dp; one activation and one gradient per micro-batch
and stage boundary for pp). Bytes are counted by wrapping the
`Communicator` methods in this process (payload bytes, not the engine's
algorithm traffic). On a machine with fewer cores than ranks this is a
correctness and relative-overhead run, not absolute speed: the loss column
shows that every mesh trains the same trajectory.

Part 2 (`-n 2`): tp=2 with hpdl's layers over MPI and over gloo, against
`torch.distributed.tensor.parallel` (ColwiseParallel / RowwiseParallel,
vocabulary-parallel loss with `loss_parallel`) on gloo, and one process;
the target is hpdl >= 1.0x torch's throughput.

Run it with `hpdl bench train --strategy hybrid [--quick]`.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections import defaultdict
from typing import Any, Callable, Optional

import numpy as np

from hpdl.bench import report
from hpdl.bench import strategy_harness as harness
from hpdl.bench.arguments import positive
from hpdl.bench.strategy_harness import Options, Ranks

__all__ = ["launch", "main", "LAYOUTS"]

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp4": {"dp": 4},
    "pp4": {"dp": 1, "pp": 4},
    "tp4": {"dp": 1, "tp": 4},
    "dp2xpp2": {"dp": 2, "pp": 2},
    "dp2xtp2": {"dp": 2, "tp": 2},
    "pp2xtp2": {"dp": 1, "pp": 2, "tp": 2},
    "dp4-zero2": {"dp": 4, "zero_stage": 2},
    "dp2xtp2-zero1": {"dp": 2, "tp": 2, "zero_stage": 1},
    "dp2xpp2-zero2": {"dp": 2, "pp": 2, "zero_stage": 2},
}
"""Every mesh of 4 ranks (and ZeRO over dp on three of them); pipelines use 4 micro-batches per step."""
TP_CONTENDERS = ("hpdl-mpi", "hpdl-gloo", "torch-tp-gloo", "single")
TARGET_VS_TORCH = 1.0
LR = 1e-3


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=positive(int), help="global batch of sequences (default 16)")
    parser.add_argument("--layers", type=positive(int), help="transformer blocks (default 4)")
    parser.add_argument("--embd", type=positive(int), help="hidden size (default 256)")
    parser.add_argument("--block", type=positive(int), help="sequence length (default 128)")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), help="meshes to run (default: all)")
    parser.add_argument("--part", choices=["all", "meshes", "torch-tp"], default="all", help="which part to run")


def _check(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    quick = bool(ns.quick)
    own = {
        "batch": ns.batch or (8 if quick else 16),
        "n_layer": ns.layers or (2 if quick else 4),
        "n_embd": ns.embd or (32 if quick else 256),
        "block": ns.block or (16 if quick else 128),
        "layouts": tuple(ns.layouts or LAYOUTS),
        "part": ns.part,
    }
    if ns.ranks != 4 and ns.part != "torch-tp":
        parser.error(f"-n {ns.ranks}: the mesh part enumerates meshes of 4 ranks; use -n 4")
    if own["n_embd"] % 4:
        parser.error(f"--embd {own['n_embd']} must be divisible by 4 (heads and tp=4)")
    if own["batch"] % 4:
        parser.error(f"--batch {own['batch']} must be divisible by 4 (dp=4 and 4 micro-batches)")
    return own


BENCH = harness.Bench(
    strategy="hybrid",
    module="hpdl.bench.train_hybrid",
    description="Every dp x pp x tp mesh of 4 ranks on a small GPT (samples/s, memory and communication volume "
    "per rank beside the analytical volume), and tp=2 against torch.distributed.tensor.parallel on 2 ranks.",
    out="bench-results/train-hybrid",
    rounds=(5, 1),
    steps=(5, 1),
    ranks=4,
    ranks_help="ranks of the mesh part",
    quick_help="a tiny model, one round of one step (seconds)",
    options=_options,
    check=_check,
)


def parse(argv: list[str]) -> Options:
    return harness.parse(BENCH, argv)


def launch(argv: list[str]) -> int:
    """Run part 1 on 4 ranks, then part 2 on 2 ranks (each its own mpiexec); return the first failure's code."""
    return harness.launch(BENCH, argv, _run_parts)


def _run_parts(options: Options) -> int:
    for part, ranks in (("meshes", 4), ("torch-tp", 2)):
        if options.part in ("all", part):
            forwarded = options.forwarded("--part", part)
            code = report.run_worker(BENCH.prog, BENCH.module, ranks, forwarded, options.timeout)
            if code:
                return code
    return 0


# --------------------------------------------------------------------------- counting communication
AXES = ("tp", "dp", "pp")
COUNTED = ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "send", "allreduce_coalesced")


class VolumeCounter:
    """Bytes handed to each hpdl communicator, by mesh axis: the payload of every collective and send.

    Installed by wrapping the public `Communicator` methods of this process
    (the benchmark's own instrumentation; nothing in hpdl depends on it).
    Communicators it does not know (the pipeline's private link) count as pp.
    """

    def __init__(self) -> None:
        self.labels: dict[int, str] = {}
        self.bytes: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.enabled = False
        self.inside = False

    def install(self) -> None:
        import hpdl.comm.mpi_backend  # noqa: F401  (the backends' own fast paths override the base's ops)
        import hpdl.comm.torch_backend  # noqa: F401
        from hpdl.comm.base import Communicator

        classes, pending = [], [Communicator]
        while pending:
            cls = pending.pop()
            classes.append(cls)
            pending += cls.__subclasses__()
        for cls in classes:
            for op in COUNTED:
                if op in vars(cls):
                    setattr(cls, op, self._wrap(op, vars(cls)[op]))

    def _wrap(self, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
        counter = self

        @functools.wraps(original)
        def counted(comm: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
            outermost = not counter.inside  # a backend's op that hands over to the base's counts once
            if outermost and counter.enabled and comm.size > 1:
                axis = counter.labels.get(id(comm), "pp")
                items = data if op == "allreduce_coalesced" else [data]
                counter.bytes[axis] += sum(_nbytes(t) for t in items)
                counter.calls[axis] += 1
            counter.inside = True
            try:
                return original(comm, data, *args, **kwargs)
            finally:
                counter.inside = not outermost

        return counted

    def label(self, mesh: Any) -> None:
        self.labels = {id(mesh.tp): "tp", id(mesh.dp): "dp", id(mesh.pp): "pp"}

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()


def _nbytes(t: Any) -> int:
    if hasattr(t, "element_size"):
        return int(t.numel() * t.element_size())
    return int(getattr(t, "nbytes", 0))


def analytic_volume(spec: dict[str, Any], options: Options, stage_layers: list[int], stage: int, params: int) -> dict:
    """Payload bytes per step that this rank should hand to each axis (float32), from the model's sizes."""
    dp, pp, tp = spec.get("dp", 1), spec.get("pp", 1), spec.get("tp", 1)
    b, s, h, e = options.batch // dp, options.block, options.n_embd, 4
    bsh = b * s * h * e
    out = {"tp": 0.0, "dp": 0.0, "pp": 0.0}
    if tp > 1:
        blocks = stage_layers[stage] - (stage == 0) - (stage == pp - 1)  # embed and head are layers too
        out["tp"] = 4 * blocks * bsh  # Megatron: 2 allreduces forward (attention, MLP), 2 backward
        if stage == 0:
            out["tp"] += bsh  # vocabulary-parallel embedding: one allreduce forward
        if stage == pp - 1:
            out["tp"] += bsh + 3 * b * s * e  # head's input gradient; loss: max, then (sum exp, target logit)
    if dp > 1:
        zero = spec.get("zero_stage", 0)
        out["dp"] = params * e * (1 if zero == 0 else 1 + 1 / dp)  # reduce (all or scatter) + stage 1/2's allgather
    if pp > 1:
        sends = (stage < pp - 1) + (stage > 0)  # activations forward, gradients backward
        out["pp"] = sends * bsh
    return out


# --------------------------------------------------------------------------- model state and helpers
def model_state_bytes(model: Any, optimizer: Any) -> int:
    """Bytes of the distinct storages behind parameters, gradients, optimizer state and ZeRO's unit buffers.

    `model`: the module this rank trains (a pipeline's stage wrapper, a DataParallel, a ZeroModel, a module).
    """
    import torch

    seen: dict[int, int] = {}

    def add(value: Any) -> None:
        if isinstance(value, (list, tuple)):
            for item in value:
                add(item)
        elif isinstance(value, torch.Tensor) and value.numel():
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in inner.state.values():
        for value in state.values():
            add(value)
    units = getattr(model, "shards", None) if type(model).__name__ == "ZeroModel" else None
    for unit in units if isinstance(units, list) else []:
        for value in vars(unit).values():
            add(value)
    return int(sum(seen.values()))


def make_config(options: Options, vocab: int) -> Any:
    from hpdl.models.gpt import GPTConfig

    return GPTConfig(
        vocab_size=vocab, block_size=options.block, n_layer=options.n_layer, n_head=4, n_embd=options.n_embd
    )


def make_data(options: Options, vocab: int, count: int = 4) -> Any:
    import torch

    g = torch.Generator().manual_seed(2026)
    ids = torch.randint(0, vocab, (count, options.batch, options.block + 1), generator=g)
    return ids[..., :-1].contiguous(), ids[..., 1:].contiguous()


# --------------------------------------------------------------------------- part 1: meshes of 4
def measure_layout(name: str, options: Options, world: Any, counter: VolumeCounter) -> dict[str, Any]:
    import torch

    from hpdl.models.gpt import GPT
    from hpdl.parallel import Mesh, Plan, build
    from hpdl.parallel.tensor import vocab_parallel_cross_entropy

    spec = dict(LAYOUTS[name])
    if spec.get("pp", 1) > 1:
        spec["micro_batches"] = 4
    plan = Plan(**spec)
    vocab = 96
    config = make_config(options, vocab)
    mesh = Mesh.from_plan(world, plan)
    counter.label(mesh)
    torch.manual_seed(0)
    model, opt = build(GPT(config), mesh, plan, optimizer=torch.optim.AdamW, lr=LR)
    loss_fn = functools.partial(vocab_parallel_cross_entropy, comm=mesh.tp)
    x, y = make_data(options, vocab)
    per = options.batch // mesh.shape["dp"]
    lo = mesh.dp.rank * per
    state = {"steps": 0, "loss": float("nan")}

    def step() -> None:
        i = state["steps"] % x.shape[0]
        xs, ys = x[i, lo : lo + per], y[i, lo : lo + per]
        opt.zero_grad()
        if hasattr(model, "step"):
            loss = model.step(xs, ys, loss_fn)
        else:
            loss = loss_fn(model(xs), ys)
            loss.backward()
        opt.step()
        state["steps"] += 1
        state["loss"] = float(loss.detach())

    step()  # warm-up (allocation, first-touch, engine connections), and one counted step
    world.barrier()
    counter.reset()
    counter.enabled = True
    step()
    counter.enabled = False
    volume = {axis: counter.bytes.get(axis, 0.0) for axis in AXES}
    times = np.zeros(options.rounds)
    for r in range(options.rounds):
        world.barrier()
        start = time.perf_counter()
        for _ in range(options.steps):
            step()
        times[r] = time.perf_counter() - start
    world_times = torch.from_numpy(times)
    world.allreduce(world_times, "max")  # a sample lasts until the slowest rank finishes
    loss = torch.tensor([state["loss"]], dtype=torch.float64)
    mesh.dp.allreduce(loss, "avg")
    params = sum(p.numel() for p in model.parameters())
    stage = mesh.pp.rank
    balance = getattr(model, "balance", [config.n_layer + 2])  # embed, blocks, head
    analytic = analytic_volume(spec, options, list(balance), stage, params)
    mine = {
        "memory": model_state_bytes(model.module if hasattr(model, "layers") else model, opt),
        "volume": volume,
        "analytic": analytic,
    }
    every = world.allgather_object(mine)
    mesh.close()
    samples = [options.batch * options.steps / t for t in world_times.tolist()]
    return {
        "layout": name,
        "dp": mesh.shape["dp"],
        "pp": mesh.shape["pp"],
        "tp": mesh.shape["tp"],
        "zero_stage": plan.zero_stage,
        "micro_batches": plan.micro_batches,
        "samples_per_s": report.summarize(samples),
        "step_ms": float(np.median(world_times.numpy())) / options.steps * 1e3,
        "memory_bytes_per_rank": [m["memory"] for m in every],
        "volume_bytes_per_step": {a: [m["volume"][a] for m in every] for a in AXES},
        "analytic_bytes_per_step": {a: [m["analytic"][a] for m in every] for a in AXES},
        "loss": float(loss),
        "steps_trained": state["steps"],
    }


def run_meshes(options: Options) -> int:
    def measure(ranks: Ranks) -> list[dict[str, Any]]:
        counter = VolumeCounter()
        counter.install()
        records = []
        for name in options.layouts:
            records.append(measure_layout(name, options, ranks.mpi, counter))
            if ranks.rank == 0:
                print(f"  {name}: {records[-1]['samples_per_s']['median']:.1f} samples/s", flush=True)
        return records

    def write(ranks: Ranks, records: list[dict[str, Any]], elapsed: float) -> None:
        config = harness.config(
            options,
            ranks,
            "train-hybrid",
            part="meshes",
            steps=options.steps,
            model=f"GPT n_layer={options.n_layer} n_embd={options.n_embd} n_head=4 block={options.block} vocab=96",
            global_batch=options.batch,
            optimizer=f"AdamW(lr={LR})",
            dtype="float32",
            cpu_oversubscribed=(os.cpu_count() or 1) < ranks.size,
        )
        write_meshes(options, records, config, elapsed)

    return harness.worker(
        measure,
        write,
        gloo=False,
        timeout=600.0,
        announce=lambda r: (
            f"hybrid meshes: {r.size} ranks, MPI {r.mpi.engine}; measuring {len(options.layouts)} meshes ..."
        ),
    )


MESH_HEADERS = [
    "mesh",
    "zero",
    "samples/s",
    "min-max",
    "vs dp4",
    "state MB/rank (max)",
    "tp MB/step",
    "tp analytic",
    "dp MB/step",
    "dp analytic",
    "pp MB/step",
    "pp analytic",
    "loss",
    "|loss - dp4|",
]


def write_meshes(options: Options, records: list[dict[str, Any]], config: dict[str, Any], elapsed: float) -> None:
    base = next((r for r in records if r["layout"] == "dp4"), records[0])
    rows = []
    for r in records:
        vol = {a: float(np.mean(r["volume_bytes_per_step"][a])) / 2**20 for a in AXES}
        ana = {a: float(np.mean(r["analytic_bytes_per_step"][a])) / 2**20 for a in AXES}
        r["vs_dp4"] = r["samples_per_s"]["median"] / base["samples_per_s"]["median"]
        r["loss_diff_vs_dp4"] = abs(r["loss"] - base["loss"])
        rows.append(
            [
                r["layout"],
                r["zero_stage"],
                r["samples_per_s"]["median"],
                f"{r['samples_per_s']['min']:.1f}-{r['samples_per_s']['max']:.1f}",
                r["vs_dp4"],
                max(r["memory_bytes_per_rank"]) / 2**20,
                vol["tp"],
                ana["tp"],
                vol["dp"],
                ana["dp"],
                vol["pp"],
                ana["pp"],
                r["loss"],
                r["loss_diff_vs_dp4"],
            ]
        )
    header = (
        f"hpdl bench train --strategy hybrid (meshes): 4 MPI ranks on {config['cpu_count']} cores"
        f"{' (oversubscribed: relative overhead and correctness, not speed)' if config['cpu_oversubscribed'] else ''}, "
        f"{config['model']}, global batch {options.batch}, {options.rounds} rounds x {options.steps} steps, "
        f"AdamW, float32, pipelines with 4 micro-batches (1F1B)"
    )
    notes = [
        "MB/step: mean over ranks of the payload bytes each rank hands to the communicator per step, by mesh axis;",
        "analytic: tp = Megatron's 4 allreduces of b*s*h per transformer layer per step + embedding (b*s*h) + head "
        "(b*s*h) + loss (3*b*s); dp = one reduction of the replica's parameters (+1/dp: ZeRO's allgather); "
        "pp = one activation forward and one gradient backward of b*s*h per stage boundary.",
        "state MB/rank: parameters + gradients + optimizer state (+ ZeRO buffers), from tensor storages.",
        "loss: every mesh trains the same model from the same weights on the same data; |loss - dp4| is rounding.",
    ]
    table = report.markdown_table(MESH_HEADERS, rows, right_align_from=1)
    text = "\n".join(["# hpdl bench train --strategy hybrid: meshes of 4", "", header, "", table, ""])
    text += "\n".join(f"- {n}" for n in notes)
    report.write_report(options.out, "meshes", text, records, config, elapsed)


# --------------------------------------------------------------------------- part 2: tp=2 against torch
def interleave_qkv(model: Any, tp: int) -> None:
    """Reorder each fused qkv projection's rows to [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], so that torch's contiguous
    ColwiseParallel split gives rank r whole heads of q, k and v (hpdl's 'qkv' style does this by itself)."""
    import torch

    for name, module in model.named_modules():
        if name.endswith("attn.qkv"):
            h = module.weight.shape[0] // 3
            order = torch.arange(3 * h).view(3, tp, h // tp).transpose(0, 1).reshape(-1)
            with torch.no_grad():
                module.weight.copy_(module.weight[order].clone())
                module.bias.copy_(module.bias[order].clone())


def torch_tp_model(config: Any, n_layer: int) -> Any:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from hpdl.models.gpt import GPT

    try:
        from torch.distributed.tensor import Replicate
    except ImportError:  # torch before 2.5, where DTensor's placements were private
        from torch.distributed._tensor import Replicate

    torch.manual_seed(0)
    model = GPT(config)
    interleave_qkv(model, 2)
    plan: dict[str, Any] = {
        "embed.tok": RowwiseParallel(input_layouts=Replicate()),
        "head.proj": ColwiseParallel(use_local_output=False),
    }
    for i in range(n_layer):
        plan[f"block{i}.attn.qkv"] = ColwiseParallel()
        plan[f"block{i}.attn.out"] = RowwiseParallel()
        plan[f"block{i}.mlp.fc"] = ColwiseParallel()
        plan[f"block{i}.mlp.proj"] = RowwiseParallel()
    return parallelize_module(model, init_device_mesh("cpu", (2,)), plan)


def run_torch_tp(options: Options) -> int:
    return harness.worker(
        lambda ranks: measure_torch_tp(options, ranks),
        lambda ranks, records, elapsed: write_torch_tp(options, records, torch_tp_config(options, ranks), elapsed),
        timeout=600.0,
    )


def torch_tp_config(options: Options, ranks: Ranks) -> dict[str, Any]:
    return harness.config(
        options,
        ranks,
        "train-hybrid",
        part="torch-tp",
        steps=options.steps,
        model=f"GPT n_layer={options.n_layer} n_embd={options.n_embd} n_head=4 block={options.block} vocab=96",
        global_batch=options.batch,
        optimizer=f"AdamW(lr={LR})",
        torch_tp="ColwiseParallel/RowwiseParallel, RowwiseParallel embedding, loss_parallel cross-entropy",
    )


def measure_torch_tp(options: Options, ranks: Ranks) -> list[dict[str, Any]]:
    """tp=2 with hpdl over MPI and gloo, torch's tensor parallelism and one process, alternating: the records."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    from hpdl.models.gpt import GPT, lm_loss
    from hpdl.parallel.tensor import parallelize, vocab_parallel_cross_entropy

    mpi, gloo = ranks.mpi, ranks.gloo
    vocab = 96
    config = make_config(options, vocab)
    x, y = make_data(options, vocab)

    def fresh() -> Any:
        torch.manual_seed(0)
        return GPT(config)

    def hpdl_step(model: Any, comm: Any) -> Callable[[Any, Any], Any]:
        def loss_of(xs: Any, ys: Any) -> Any:
            return vocab_parallel_cross_entropy(model(xs), ys, comm)

        return loss_of

    def torch_loss(model: Any) -> Callable[[Any, Any], Any]:
        def loss_of(xs: Any, ys: Any) -> Any:
            with loss_parallel():
                loss = F.cross_entropy(model(xs).flatten(0, 1), ys.flatten())
                loss.backward()
            full = getattr(loss, "full_tensor", None)  # a DTensor under loss_parallel
            return full().detach() if full is not None else loss.detach()

        return loss_of

    contenders: dict[str, dict[str, Any]] = {}
    for name in TP_CONTENDERS:
        if name == "hpdl-mpi":
            model = parallelize(fresh(), mpi)
            loss_of, sync = hpdl_step(model, mpi), mpi.barrier
        elif name == "hpdl-gloo":
            model = parallelize(fresh(), gloo)
            loss_of, sync = hpdl_step(model, gloo), dist.barrier
        elif name == "torch-tp-gloo":
            model = torch_tp_model(config, options.n_layer)
            loss_of, sync = torch_loss(model), dist.barrier
        else:
            model = fresh()

            def plain(xs: Any, ys: Any, model: Any = model) -> Any:
                return lm_loss(model(xs), ys)

            loss_of, sync = plain, dist.barrier
        contenders[name] = {
            "model": model,
            "opt": torch.optim.AdamW(model.parameters(), lr=LR),
            "loss_of": loss_of,
            "sync": sync,
            "active": name != "single" or mpi.rank == 0,
            "steps": 0,
            "loss": float("nan"),
            "self_backward": name == "torch-tp-gloo",
        }

    def run(c: dict[str, Any], steps: int) -> None:
        for _ in range(steps):
            i = c["steps"] % x.shape[0]
            c["opt"].zero_grad()
            loss = c["loss_of"](x[i], y[i])
            if not c["self_backward"]:
                loss.backward()
            c["opt"].step()
            c["steps"] += 1
            c["loss"] = float(loss.detach())

    for c in contenders.values():
        c["sync"]()
        if c["active"]:
            run(c, 1)
        c["sync"]()
    order = list(contenders.values())

    def timed(i: int) -> None:
        if order[i]["active"]:
            run(order[i], options.steps)

    times = harness.alternate(len(order), options.rounds, timed, lambda i: order[i]["sync"](), mpi)
    records = []
    for i, (name, c) in enumerate(contenders.items()):
        samples = [options.batch * options.steps / s for s in times[i].tolist()]
        records.append(
            {
                "contender": name,
                "ranks": 1 if name == "single" else 2,
                "samples_per_s": report.summarize(samples),
                "step_ms": float(np.median(times[i])) / options.steps * 1e3,
                "loss": c["loss"],
                "steps_trained": c["steps"],
            }
        )
    return records


def write_torch_tp(options: Options, records: list[dict[str, Any]], config: dict[str, Any], elapsed: float) -> None:
    by = {r["contender"]: r for r in records}
    torch_rate = by["torch-tp-gloo"]["samples_per_s"]["median"]
    single = by["single"]["samples_per_s"]["median"]
    rows = []
    for r in records:
        r["vs_torch_tp"] = r["samples_per_s"]["median"] / torch_rate
        r["vs_single"] = r["samples_per_s"]["median"] / single
        s = r["samples_per_s"]
        rows.append(
            [
                r["contender"],
                r["ranks"],
                s["median"],
                f"{s['min']:.1f}-{s['max']:.1f}",
                r["vs_torch_tp"],
                r["vs_single"],
                r["step_ms"],
                r["loss"],
            ]
        )
    verdicts = [
        harness.faster(f"{name}:", by[name]["vs_torch_tp"], "torch.distributed.tensor.parallel", TARGET_VS_TORCH)
        for name in ("hpdl-mpi", "hpdl-gloo")
    ]
    header = (
        f"tp=2 on 2 ranks: {config['model']}, batch {options.batch} (every tp rank sees the whole batch), "
        f"{options.rounds} rounds x {options.steps} steps, AdamW, float32, alternating contenders"
    )
    table = report.markdown_table(
        ["contender", "ranks", "samples/s", "min-max", "vs torch TP", "vs single", "step ms", "loss"],
        rows,
        right_align_from=1,
    )
    notes = [
        "torch-tp-gloo: torch.distributed.tensor.parallel with the same layout (qkv rows reordered so that its "
        "contiguous column split keeps whole heads), vocabulary-parallel loss with loss_parallel().",
        "loss: the same model, weights and data: every contender trains the same trajectory.",
    ]
    text = "\n".join(["# hpdl bench train --strategy hybrid: tp=2 against torch", "", header, "", table, ""])
    text += "\n".join(f"- {n}" for n in notes) + "\n\n## Targets\n\n" + "\n".join(f"- {v}" for v in verdicts)
    report.write_report(options.out, "tp-vs-torch", text, records, config, elapsed)


def main(argv: Optional[list[str]] = None) -> int:
    """`launch` by default; with --worker, `worker` (every rank)."""
    return harness.main(BENCH, launch, worker, argv)


def worker(options: Options) -> int:
    """The worker (every rank) of one part: the meshes on 4 ranks, or tp=2 against torch on 2."""
    return run_meshes(options) if options.part == "meshes" else run_torch_tp(options)


if __name__ == "__main__":
    sys.exit(main())
