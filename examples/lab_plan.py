"""A lab: plan a model for a cluster we do not have, then run the chosen plan at small scale here and compare.

    hpdl launch -n 2 examples/lab_plan.py        (or -n 4)

1. Simulate: GPT-2 XL with a global batch of 512 on 16 nodes of 8 A100-80GB
   (datasheet figures): what does every strategy cost, and which wins?
2. Calibrate here: every rank measures its matmul rate and the ranks time
   a few allreduces on the live communicator; the alpha-beta fit becomes
   this machine's cluster description.
3. Plan a small GPT (hpdl.models.gpt) for these ranks, write the best plan
   to a file, load it back, and run it with `hpdl.parallel.build`.
4. Compare the predicted step time with the measured one. On a quiet
   machine they agree within tens of percent; on a shared one, expect noise.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

import hpdl
from hpdl.models.gpt import GPT, GPTConfig, lm_loss
from hpdl.parallel.mesh import Mesh, build
from hpdl.parallel.mesh.plan_config import Plan
from hpdl.plan import Cluster, Link, Workload, measure, parse_cluster, reference_profile, search
from hpdl.plan.calibrate import fit_alpha_beta, measure_compute
from hpdl.plan.report import describe, fmt_s, ranking_table, why

CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=4, n_embd=64)
BATCH, STEPS, WARMUP = 16, 5, 1


def say(comm, text: str) -> None:
    if comm.rank == 0:
        print(text, flush=True)


def calibrate_here(comm) -> Cluster:
    """This machine as a one-node cluster: measured matmul rate (while every rank computes) and allreduce fit."""
    rate = min(comm.allgather_object(measure_compute(size=256, reps=2, threads=1)["fp32"]))
    points = []
    for nbytes in (4, 1 << 14, 1 << 18, 1 << 20):
        t = torch.ones(nbytes // 4)
        samples = []
        for _ in range(7):
            comm.barrier()
            start = time.perf_counter()
            comm.allreduce(t)
            samples.append(time.perf_counter() - start)
        points.append((nbytes, max(comm.allgather_object(statistics.median(samples)))))
    n = comm.size
    link = fit_alpha_beta(points, 2 * (n - 1), 2 * (n - 1) / n) if n > 1 else Link("none", 1e-6, 1e10)
    return Cluster(
        name=f"here ({n} ranks)",
        nodes=1,
        devices_per_node=n,
        memory_bytes=2e9,
        flops={"fp32": rate},
        intra=link,
        inter=link,
        memory_bandwidth_Bps=5e9,
        op_overhead_s=4e-6,
        tensor_overhead_s=3e-5,
        pass_overhead_s=2e-4,
        overlap=0.0,
        source="measured by examples/lab_plan.py (matmul rate with every rank busy; allreduce fit)",
    )


def run_plan(comm, plan: Plan) -> float:
    """Median step time (slowest rank) of `plan` on the small GPT."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    mesh = Mesh.from_plan(comm, plan)
    try:
        wrapped, optimizer = build(model, mesh, plan, optimizer=torch.optim.Adam, lr=1e-3)
        if plan.tp > 1:
            from hpdl.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy

            def loss_fn(out, y):
                return vocab_parallel_cross_entropy(out, y, mesh.tp)
        else:
            loss_fn = lm_loss
        rows = BATCH // plan.dp
        dp_index = mesh.coordinates()["dp"]
        times = []
        for step in range(STEPS + WARMUP):
            g = torch.Generator().manual_seed(step * 100 + dp_index)
            ids = torch.randint(0, CONFIG.vocab_size, (rows, CONFIG.block_size + 1), generator=g)
            x, y = ids[:, :-1], ids[:, 1:]
            comm.barrier()
            start = time.perf_counter()
            if plan.pp > 1:
                wrapped.step(x, y, loss_fn)
            else:
                loss_fn(wrapped(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if step >= WARMUP:
                times.append(time.perf_counter() - start)
        return max(comm.allgather_object(statistics.median(times)))
    finally:
        mesh.close()


def main() -> None:
    comm = hpdl.init()

    # 1. A cluster we do not have.
    far = parse_cluster("nodes=16,gpus_per_node=8,gpu=a100-80,intra=nvlink,inter=ib-200")
    result = search(reference_profile("gpt2-xl"), far, Workload(batch=512))
    say(comm, f"== 1. GPT-2 XL, batch 512, on {far.name} ({far.source})")
    say(comm, f"{len(result.estimates)} candidates in {result.elapsed_s:.2f} s, {len(result.feasible)} fit")
    say(comm, ranking_table(result, top=5))
    say(comm, why(result))

    # 2. This machine, measured.
    here = calibrate_here(comm)
    link = here.intra
    say(comm, f"\n== 2. This machine: {here.flops['fp32'] / 1e9:.1f} GFLOP/s per rank (fp32, one thread), "
              f"allreduce alpha {link.latency_s * 1e6:.1f} us, {link.bandwidth_Bps / 1e9:.2f} GB/s")  # fmt: skip

    # 3. Plan the small GPT here (on rank 0: one decision for every rank), write the plan file, read it back.
    path = os.path.join(tempfile.gettempdir(), f"hpdl-lab-plan-{os.getppid()}.toml")
    chosen = None
    if comm.rank == 0:
        model = GPT(CONFIG)
        # Each layer runs once for FLOPs, bytes and parameters, and is timed at two batch sizes on this machine.
        profile = measure(model, lambda b: torch.randint(0, CONFIG.vocab_size, (b, CONFIG.block_size)),
                          name="small GPT", time_batches=(2, BATCH))  # fmt: skip
        small = search(profile, here, Workload(batch=BATCH, precision="fp32"), max_micro_batches=4, measured=True)
        best = small.best
        print(f"\n== 3. Small GPT ({profile.params:,} parameters) on {comm.size} ranks: best {describe(best)}, "
              f"predicted {fmt_s(best.step_s)} per step")  # fmt: skip
        small.best_plan().to_file(path)
        # The runner-up with another layout (pp, tp), to compare two plans.
        others = [
            e for e in small.feasible if (e.candidate.pp, e.candidate.tp) != (best.candidate.pp, best.candidate.tp)
        ]
        chosen = [(describe(e), e.step_s, _fields(e, small)) for e in [best, *others[:1]]]
    chosen = comm.broadcast_object(chosen, root=0)
    plan = Plan.from_file(path)
    say(comm, plan.describe())

    # 4. Run them and compare.
    say(comm, "\n== 4. Predicted vs measured (median step of the slowest rank)")
    for i, (text, predicted, fields) in enumerate(chosen):
        measured = run_plan(comm, plan if i == 0 else Plan(**fields))
        say(comm, f"   {text:55s} predicted {fmt_s(predicted):>9s}   measured {fmt_s(measured):>9s}"
                  f"   ratio {predicted / measured:.2f}")  # fmt: skip
    comm.barrier()
    if comm.rank == 0:
        os.remove(path)
    hpdl.finalize()


def _fields(estimate, result):
    from hpdl.plan.ranking import plan_fields

    return plan_fields(estimate.candidate, result.workload, estimate.stage_layers)


if __name__ == "__main__":
    main()
