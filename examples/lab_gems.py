"""A lab: GEMS-MASTER, two mirrored replicas of a pipeline on the same ranks, trained on scikit-learn's digits.

    hpdl launch -n 2 examples/lab_gems.py          (or -n 4; --steps 60)

Rank r holds stage r of replica A and stage p-1-r of replica B. Replica A's
micro-batches enter at rank 0 while replica B's enter at rank p-1, so each
one's forwards run in the other's warm-up and drain: the schedule below has
no idle slot on 2 ranks, where one 1F1B pipeline idles 1/(m+1) of the step.
The two copies of every stage sum their gradients (partner ranks r and
p-1-r: through shared memory when they share a node, else by messages) and
stay equal; training equals one process on the whole batch.
Each part prints what every rank holds and checks the claim it makes.
"""

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn

import hpdl
from hpdl.parallel import Pipeline
from hpdl.parallel.pipe.schedule import make_schedule


def show(comm, title: str, line: str) -> None:
    lines = comm.allgather_object(line)
    if comm.rank == 0:
        print(f"\n== {title}")
        for rank, text in enumerate(lines):
            print(f"   rank {rank}: {text}")


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(),
                         nn.Linear(32, 10)).double()  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=8)
    args = parser.parse_args()
    comm = hpdl.init()
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float64)
    y = torch.tensor(digits.target)
    loss_fn = nn.functional.cross_entropy

    pipe = Pipeline(model(), comm, chunks=args.chunks, schedule="gems", checkpoint="never")
    show(comm, "placement: every rank holds two stages, in opposite order for the two replicas",
         f"stage {pipe.stage} of replica A (layers {pipe.first_layer}..), stage {pipe.mirror_stage} of replica B "
         f"(layers {pipe.mirror_first_layer}..); partner rank {pipe.partner}, the copies' gradients summed "
         f"through {pipe.gradient_exchange}")  # fmt: skip
    schedule = pipe.schedule()
    one = make_schedule("1f1b", comm.size, args.chunks)
    if comm.rank == 0:
        print("\n== the schedule (A upper case, B lower case): one replica's bubble is the other's work")
        print(schedule.draw())
        print(f"\n   one 1F1B pipeline with the same {args.chunks} micro-batches:")
        print(one.draw())
        print(f"   grid bubble: gems {schedule.bubble:.3f} vs 1f1b {one.bubble:.3f} "
              f"(at most half: {schedule.bubble <= one.bubble / 2})")  # fmt: skip
        assert schedule.bubble <= one.bubble / 2

    reference = model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.2, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(args.steps):
        rows = torch.randint(0, len(y), (args.batch,), generator=g)
        opt.zero_grad()
        loss = pipe.step(x[rows], y[rows], loss_fn)
        opt.step()
        ref_opt.zero_grad()
        loss_fn(reference(x[rows]), y[rows]).backward()
        ref_opt.step()
        losses.append(float(loss))
    fell = losses[-1] < losses[0] / 2
    show(comm, "training: the batch's mean loss comes back on every rank",
         f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (fell: {fell})")  # fmt: skip
    assert fell

    # Both copies of a stage stay equal, and equal one process trained on the same batches.
    ref = dict(reference.named_parameters())
    worst = 0.0
    for layers, first in ((pipe.layers, pipe.first_layer), (pipe.mirror_layers, pipe.mirror_first_layer)):
        for name, p in layers.named_parameters():
            index, rest = name.split(".", 1)
            worst = max(worst, float((p - ref[f"{first + int(index)}.{rest}"]).detach().abs().max()))
    same = worst < 1e-9
    show(comm, "equivalence: both copies this rank holds vs one process on the whole batches",
         f"max |difference| {worst:.2e} (same: {same})")  # fmt: skip
    assert same

    planned = schedule.peak_live(comm.rank)
    show(comm, "memory: micro-batches held at once, counted by the engine, both replicas together",
         f"peak {pipe.stats.peak_live} == schedule's {planned}: {pipe.stats.peak_live == planned}; "
         f"ran exactly the schedule: {list(pipe.stats.actions) == schedule.actions(comm.rank)}")  # fmt: skip
    assert pipe.stats.peak_live == planned
    pipe.close()
    hpdl.finalize()


if __name__ == "__main__":
    main()
