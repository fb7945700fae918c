"""A lab: one unmodified DDP training script, on torch's gloo and on the "hpdl" backend, side by side.

    hpdl launch -n 2 examples/lab_torch_backend.py [--steps 30]
    mpiexec -n 2 python examples/lab_torch_backend.py      # the same: no MASTER_ADDR needed

`dist.init_process_group("hpdl")` is the only line that names hpdl; a gloo
group of the same ranks runs the same DDP code beside it. The lab trains
an MLP (784-1024-1024-10, batch 64 per rank) on both, alternating in
blocks, prints both speeds and checks that the parameters are equal. One
run on a busy machine is an illustration, not a benchmark: `hpdl bench
torch` measures with repetitions.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hpdl  # noqa: F401  (registers the "hpdl" backend)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("hpdl")
    rank, size = dist.get_rank(), dist.get_world_size()
    groups = {"gloo": dist.new_group(backend="gloo"), "hpdl": dist.group.WORLD}
    models = {name: DDP(make_model(), process_group=g) for name, g in groups.items()}
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for name, m in models.items()}
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(64, 784, generator=gen), torch.randint(0, 10, (64,), generator=gen)) for _ in range(4)]
    seconds = {name: 0.0 for name in models}
    block = 5
    for start in range(0, args.steps, block):
        for name in ("gloo", "hpdl") if (start // block) % 2 == 0 else ("hpdl", "gloo"):
            dist.barrier(group=groups[name])
            began = time.perf_counter()
            for step in range(start, min(start + block, args.steps)):
                x, y = batches[step % len(batches)]
                optimizers[name].zero_grad()
                F.cross_entropy(models[name](x), y).backward()
                optimizers[name].step()
            dist.barrier(group=groups[name])
            seconds[name] += time.perf_counter() - began
    diff = max(
        float((a.detach() - b.detach()).abs().max())
        for a, b in zip(models["gloo"].parameters(), models["hpdl"].parameters())
    )
    same = diff == 0.0
    for name in ("gloo", "hpdl"):
        rate = 64 * size * args.steps / seconds[name]
        print(f"rank {rank}: DDP on {name}: {rate:8.0f} samples/s ({seconds[name]:.2f} s for {args.steps} steps)")
    print(f"rank {rank}: parameters after {args.steps} steps: largest difference {diff:.1e} (same: {same})")
    if not same:
        raise SystemExit(f"rank {rank}: DDP on hpdl and on gloo disagree by {diff}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
