"""The composed part of `hpdl bench train --strategy zero` (4 ranks): ZeRO-3 inside dp2 x pp2 and dp2 x tp2.

Contenders, built with `hpdl.parallel.build(GPT, mesh, Plan(...))` on the
same 4 MPI ranks, weights and data, alternating per round:

    dp2xpp2-z3        ZeRO-3 over each pipeline stage's dp group (1F1B, 4 micro-batches), units regathered per
                      micro-batch (reshard_after_forward, FSDP2's default)
    dp2xpp2-z3-kept   the same with reshard_after_forward=False (units kept gathered across the micro-batches)
    dp2xpp2-z2        ZeRO-2 in the same layout: the peer (a full parameter copy per dp rank)
    dp2xtp2-z3        ZeRO-3 over dp of each tp rank's slices
    dp2xtp2-z2        ZeRO-2 in the same layout: the peer

The peer is hpdl's ZeRO-2 in the same layout: the hybrid bench has no FSDP2
composed with torch's pipelining or DTensor TP to stand beside these. One
ZeRO unit per transformer block (the plan's bucket_mb is just under a
block's bytes per tp slice), as torchtitan wraps FSDP2 per block. The peak
model state (parameters, gradients, optimizer state, ZeRO's buffers) and
the peak of all live tensors (the 2-rank part's measure) are sampled after
each Linear's forward, after backward and after the step, one contender
at a time, per rank; the table shows the largest.
"""

from __future__ import annotations

import functools
import gc
import os
from typing import Any, Callable
from unittest import mock

import numpy as np

from hpdl.bench import report
from hpdl.bench import strategy_harness as harness
from hpdl.bench.live_tensors import live_bytes
from hpdl.bench.strategy_harness import Options, Ranks

__all__ = ["COMPOSED", "RANKS", "sizes", "run"]

RANKS = 4
COMPOSED: dict[str, dict[str, Any]] = {
    "dp2xpp2-z3": {"dp": 2, "pp": 2, "zero_stage": 3},
    "dp2xpp2-z3-kept": {"dp": 2, "pp": 2, "zero_stage": 3, "reshard_after_forward": False},
    "dp2xpp2-z2": {"dp": 2, "pp": 2, "zero_stage": 2},
    "dp2xtp2-z3": {"dp": 2, "tp": 2, "zero_stage": 3},
    "dp2xtp2-z2": {"dp": 2, "tp": 2, "zero_stage": 2},
}
"""Layout -> Plan keywords; pipelines run 1F1B with 4 micro-batches."""
PEERS = {"dp2xpp2-z3": "dp2xpp2-z2", "dp2xtp2-z3": "dp2xtp2-z2"}
"""ZeRO-3 row -> its ZeRO-2 peer in the same layout (the memory target: ZeRO-3 at most ZeRO-2's peak)."""
VOCAB = 96
MICRO_BATCHES = 4
LR = 1e-3


def sizes(quick: bool) -> dict[str, int]:
    """The GPT and batch: the hybrid bench's (4 blocks, 256 wide, 128 tokens, 16 sequences); tiny with --quick."""
    if quick:
        return {"n_layer": 2, "n_embd": 32, "block": 16, "batch": 8}
    return {"n_layer": 4, "n_embd": 256, "block": 128, "batch": 16}


def _gpt(size: dict[str, int]) -> Any:
    import torch

    from hpdl.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=VOCAB, block_size=size["block"], n_layer=size["n_layer"], n_head=4, n_embd=size["n_embd"]
    )
    return GPT(config)


def _plan(name: str, size: dict[str, int]) -> Any:
    from hpdl.parallel import Plan

    spec = dict(COMPOSED[name])
    if spec.get("pp", 1) > 1:
        spec.update(micro_batches=MICRO_BATCHES, schedule="1f1b")
    h, tp = size["n_embd"], spec.get("tp", 1)
    block_bytes = 4 * 12 * h * h / tp  # qkv 3h^2, out h^2, MLP 8h^2 (split over tp)
    return Plan(bucket_mb=0.9 * block_bytes / 2**20, **spec)  # one ZeRO unit per block


class Contender:
    """One layout's mesh, model and optimizer, and its step (forward, backward, optimizer) on this dp rank's slice."""

    def __init__(self, name: str, world: Any, size: dict[str, int], data: tuple[Any, Any]) -> None:
        import torch

        from hpdl.parallel import Mesh, build
        from hpdl.parallel.tensor import vocab_parallel_cross_entropy

        self.name, self.size = name, size
        self.plan = _plan(name, size)
        self.mesh = Mesh.from_plan(world, self.plan)
        self.model, self.optimizer = build(_gpt(size), self.mesh, self.plan, optimizer=torch.optim.AdamW, lr=LR)
        self.loss_fn = functools.partial(vocab_parallel_cross_entropy, comm=self.mesh.tp)
        per = size["batch"] // self.mesh.shape["dp"]
        lo = self.mesh.dp.rank * per
        self.x, self.y = data[0][:, lo : lo + per], data[1][:, lo : lo + per]
        self.steps, self.loss = 0, float("nan")

    @property
    def module(self) -> Any:
        """The nn.Module this rank runs (a pipeline's stage wrapper, or the model)."""
        return getattr(self.model, "module", self.model) if hasattr(self.model, "layers") else self.model

    def run(self, steps: int, probe: Callable[[], None] = lambda: None) -> None:
        for _ in range(steps):
            i = self.steps % self.x.shape[0]
            xs, ys = self.x[i], self.y[i]
            self.optimizer.zero_grad()
            if hasattr(self.model, "step"):
                loss = self.model.step(xs, ys, self.loss_fn)
            else:
                loss = self.loss_fn(self.model(xs), ys)
                loss.backward()
            probe()
            self.optimizer.step()
            probe()
            self.steps += 1
        self.loss = float(loss.detach())

    def close(self) -> None:
        close = getattr(self.model, "close", None)
        if close is not None:
            close()
        self.mesh.close()


def _data(size: dict[str, int], count: int = 4) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(2026)
    ids = torch.randint(0, VOCAB, (count, size["batch"], size["block"] + 1), generator=g)
    return ids[..., :-1].contiguous(), ids[..., 1:].contiguous()


def peak_memory(name: str, world: Any, size: dict[str, int], data: tuple[Any, Any]) -> dict[str, int]:
    """This rank's peaks over one step (the second: every buffer a step uses exists): `state`, the model state
    (parameters, gradients, optimizer state, ZeRO's buffers and gathered units), and `live`, every live
    tensor's storage above the pre-build baseline (the 2-rank table's measure: the activations a pipeline
    stage keeps for its micro-batches' backward as well, which outweigh the state of this small GPT)."""
    from torch import nn

    from hpdl.bench.train_hybrid import model_state_bytes

    gc.collect()
    before = live_bytes()
    peak, active = {"state": 0, "live": 0}, [False]
    c = Contender(name, world, size, data)

    def probe(*_: Any) -> None:
        if active[0]:
            now = live_bytes()
            peak["live"] = max(peak["live"], sum(b for ptr, b in now.items() if ptr not in before))
            peak["state"] = max(peak["state"], model_state_bytes(c.module, c.optimizer))

    hooks = [m.register_forward_hook(probe, prepend=True) for m in c.module.modules() if isinstance(m, nn.Linear)]
    try:
        c.run(1)
        active[0] = True
        c.run(1, probe)
    finally:
        for h in hooks:
            h.remove()
        c.close()
    return peak  # the contender goes with this frame; the next call collects before its baseline


def measure(options: Options, ranks: Ranks) -> list[dict[str, Any]]:
    """Memory phase (one contender at a time), then every contender timed in alternating rounds: the records."""
    import torch

    world, size = ranks.mpi, sizes(options.quick)
    data = _data(size)
    gc.collect()
    gc.freeze()  # torch's own objects stay out of every probe's scan
    # the meshes' communicators: no shared-memory staging buffers, model state only
    with mock.patch.dict(os.environ, {"HPDL_SHM": "0"}):
        try:
            memory = {n: peak_memory(n, world, size, data) for n in options.layouts}
        finally:
            gc.unfreeze()
    contenders = [Contender(n, world, size, data) for n in options.layouts]
    for c in contenders:
        world.barrier()
        c.run(options.warmup)
    times = harness.alternate(
        len(contenders), options.rounds, lambda i: contenders[i].run(options.steps), lambda i: world.barrier(), world
    )
    params = sum(p.numel() for p in _gpt(size).parameters())
    records = []
    for i, c in enumerate(contenders):
        loss = torch.tensor([c.loss], dtype=torch.float64)
        c.mesh.dp.allreduce(loss, "avg")  # the dp replicas' mean: the global batch's loss
        every = world.allgather_object(memory[c.name])
        records.append(
            {
                "layout": c.name,
                **{axis: c.mesh.shape[axis] for axis in ("dp", "pp", "tp")},
                "zero_stage": c.plan.zero_stage,
                "reshard_after_forward": c.plan.reshard_after_forward,
                "micro_batches": c.plan.micro_batches,
                "ranks": world.size,
                "params": params,
                "global_batch": size["batch"],
                "steps_per_sample": options.steps,
                "samples_per_s": report.summarize([size["batch"] * options.steps / t for t in times[i]]),
                "step_ms": float(np.median(times[i])) / options.steps * 1e3,
                "loss": float(loss),
                "peak_model_state_bytes_per_rank": [m["state"] for m in every],
                "peak_model_state_bytes": max(m["state"] for m in every),
                "peak_live_tensor_bytes_per_rank": [m["live"] for m in every],
                "peak_live_tensor_bytes": max(m["live"] for m in every),
            }
        )
        c.close()
    return records


HEADERS = [
    "layout",
    "zero",
    "samples/s (median)",
    "min-max",
    "vs ZeRO-2",
    "peak model state MB/rank (max)",
    "peak live tensors MB/rank (max)",
    "loss",
]


def write(options: Options, ranks: Ranks, records: list[dict[str, Any]], elapsed: float) -> None:
    by = {r["layout"]: r for r in records}
    rows, verdicts = [], []
    for r in records:
        peer = by.get(next((p for z3, p in PEERS.items() if r["layout"].startswith(z3)), ""))
        r["vs_zero2"] = r["samples_per_s"]["median"] / peer["samples_per_s"]["median"] if peer else None
        s = r["samples_per_s"]
        zero = f"{r['zero_stage']}" + ("" if r["reshard_after_forward"] else " (kept)")
        rows.append(
            [
                r["layout"],
                zero,
                s["median"],
                f"{s['min']:.1f}-{s['max']:.1f}",
                r["vs_zero2"],
                r["peak_model_state_bytes"] / 2**20,
                r["peak_live_tensor_bytes"] / 2**20,
                r["loss"],
            ]
        )
    for z3, z2 in PEERS.items():
        a, b = by.get(z3), by.get(z2)
        if a is None or b is None:
            absent = " and ".join(n for n, r in ((z3, a), (z2, b)) if r is None)
            verdicts.append(f"n/a {z3}: peak model state vs {z2}: no {absent} in this run")
            continue
        got = a["peak_model_state_bytes"] / b["peak_model_state_bytes"]
        verdicts.append(
            f"{report.verdict(got <= 1.0)} {z3}: peak model state {got:.2f}x {z2}'s, the same layout with "
            "ZeRO-2 (target <= 1.0x)"
        )
    size = sizes(options.quick)
    model = f"GPT n_layer={size['n_layer']} n_embd={size['n_embd']} n_head=4 block={size['block']} vocab={VOCAB}"
    config = harness.config(
        options,
        ranks,
        "train-zero",
        part="composed",
        steps=options.steps,
        model=model,
        optimizer=f"AdamW(lr={LR})",
        dtype="float32",
        cpu_oversubscribed=(os.cpu_count() or 1) < ranks.size,
    )
    header = (
        f"hpdl bench train --strategy zero (composed): {ranks.size} MPI ranks on {config['cpu_count']} cores"
        f"{' (oversubscribed)' if config['cpu_oversubscribed'] else ''}, {model}, global batch {size['batch']}, "
        f"{options.rounds} rounds x {options.steps} steps, AdamW lr {LR}, float32, pipelines 1F1B with "
        f"{MICRO_BATCHES} micro-batches, one ZeRO unit per transformer block"
    )
    notes = [
        "samples/s = global batch x steps / sample time (slowest rank); min-max over rounds; contenders alternate.",
        "vs ZeRO-2: samples/s over hpdl ZeRO-2 in the same layout (the peer: no FSDP2 + torch pipelining or "
        "DTensor TP runs in the hybrid bench to stand beside these).",
        "peak model state: parameters, gradients, optimizer state and ZeRO's buffers (gathered units included), "
        "from their tensor storages, sampled after each Linear's forward, after backward and after the step; "
        "the largest over the 4 ranks. The target compares it.",
        "peak live tensors: the 2-rank table's measure at the same points (every live tensor's storage above the "
        "pre-build baseline), so it also holds the activations a pipeline stage keeps for its micro-batches' "
        "backward, which on this small GPT outweigh the model state.",
        "kept: reshard_after_forward=False, the stage's units stay gathered across its micro-batches.",
        "loss: the same model, weights and data in every layout: the same trajectory.",
    ]
    table = report.markdown_table(HEADERS, rows, right_align_from=2)
    text = ("hpdl bench train --strategy zero: ZeRO-3 composed with pp and tp", header, [table], notes, verdicts)
    harness.write(options, "train_zero_composed", text, records, config, elapsed)


def run(options: Options) -> int:
    """The worker of the composed part (every one of the 4 ranks): MPI only."""
    return harness.worker(
        lambda ranks: measure(options, ranks),
        lambda ranks, records, elapsed: write(options, ranks, records, elapsed),
        gloo=False,
        timeout=600.0,
        announce=lambda r: f"zero composed: {r.size} ranks, MPI {r.mpi.engine}; {len(options.layouts)} layouts ...",
    )
