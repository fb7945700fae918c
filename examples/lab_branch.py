"""A lab: branch (sub-graph) parallelism, an Inception-style block's branches on different ranks, on digits.

    hpdl launch -n 2 examples/lab_branch.py          (or -n 3, 4; --steps 60)

The block has four independent branches of different cost (1x1; 1x1-3x3;
1x1-5x5; pool-1x1) whose outputs are concatenated along channels. Each rank
runs only the branches placed on it (balanced by their measured cost), and
one allgather-v merges them; in backward each rank keeps its slice of the
output gradient, and the gradient of the block's input is summed over the
ranks (each rank's covers only its own branches). The stem before the
block shows why that sum matters. Each part checks the claim it makes.
"""

import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn

import hpdl
from hpdl.parallel.branch import BranchParallel
from hpdl.parallel.branch.placement import loads


def show(comm, title: str, line: str) -> None:
    lines = comm.allgather_object(line)
    if comm.rank == 0:
        print(f"\n== {title}")
        for rank, text in enumerate(lines):
            print(f"   rank {rank}: {text}")


class Concat(nn.Module):
    def __init__(self, branches):
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x):
        return torch.cat([b(x) for b in self.branches], 1)


NAMES = ["1x1", "1x1-3x3", "1x1-5x5", "pool-1x1"]


def build(comm=None, sample=None) -> nn.Sequential:
    """The CNN; its block is BranchParallel over `comm`, or (comm None) all four branches in this process."""
    torch.manual_seed(0)
    c = 8
    stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.Tanh())
    branches = [nn.Sequential(nn.Conv2d(c, 8, 1), nn.Tanh()),
                nn.Sequential(nn.Conv2d(c, 8, 1), nn.Tanh(), nn.Conv2d(8, 16, 3, padding=1), nn.Tanh()),
                nn.Sequential(nn.Conv2d(c, 4, 1), nn.Tanh(), nn.Conv2d(4, 16, 5, padding=2), nn.Tanh()),
                nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(c, 8, 1), nn.Tanh())]  # fmt: skip
    block = Concat(branches) if comm is None else BranchParallel(branches, "concat", comm, sample=sample)
    return nn.Sequential(stem, block, nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(48 * 4, 10)).double()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    comm = hpdl.init()
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float64).unsqueeze(1)
    y = torch.tensor(digits.target)
    loss_fn = nn.functional.cross_entropy

    sample = torch.randn(args.batch, 8, 8, 8, dtype=torch.float64)
    net = build(comm, sample=sample.float())
    net.double()
    block = net[1]
    costs = [round(c * 1e3, 3) for c in block.costs]
    show(comm, "placement: each branch on one rank, longest first onto the least loaded rank",
         f"runs {[NAMES[i] for i in block.owned]}; measured ms per branch (all ranks agree) {costs}; "
         f"load {loads(block.costs, block.placement, comm.size)[comm.rank] * 1e3:.3f} ms")  # fmt: skip

    reference = build()
    opt = torch.optim.SGD(net.parameters(), lr=0.3, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.3, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(args.steps):
        rows = torch.randint(0, len(y), (args.batch,), generator=g)
        for model, optimizer in ((net, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            loss = loss_fn(model(x[rows]), y[rows])
            loss.backward()
            if step == 0 and model is net:
                stem_grad = net[0][0].weight.grad.clone()
            if step == 0 and model is reference:
                ref_stem = reference[0][0].weight.grad.clone()
            optimizer.step()
            if model is net:
                losses.append(float(loss.detach()))

    # Why the input gradient is summed: one rank's part alone misses the other ranks' branches.
    with torch.no_grad():
        h = net[0](x[:8])
    h.requires_grad_(True)
    own = torch.cat([b(h).reshape(-1) for b in block.branches]).sum()
    partial = torch.autograd.grad(own, h)[0].abs().sum().item()
    h2 = h.detach().requires_grad_(True)
    full = torch.autograd.grad(reference[1](h2).sum(), h2)[0].abs().sum().item()
    show(comm, "backward: the block's input gradient, this rank's branches alone vs all branches",
         f"|grad| {partial:.3f} of {full:.3f} (summed over the ranks in backward, so the stem learns right: "
         f"stem grad equal: {torch.allclose(stem_grad, ref_stem, atol=1e-12)})")  # fmt: skip
    assert torch.allclose(stem_grad, ref_stem, atol=1e-12)

    fell = sum(losses[-5:]) / 5 < losses[0] * 0.7
    show(comm, "training: the same loss on every rank", f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (fell: {fell})")
    assert fell
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in net.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["1", "branches"]:  # the block keeps only its own branches: back to their indices
            parts[2] = str(block.owned[int(parts[2])])
        worst = max(worst, float((p - ref[".".join(parts)]).detach().abs().max()))
    same = worst < 1e-9
    show(comm, "equivalence: this rank's parameters vs one process after the same steps",
         f"max |difference| {worst:.2e} (same: {same})")  # fmt: skip
    assert same
    hpdl.finalize()


if __name__ == "__main__":
    main()
