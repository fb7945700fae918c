"""Branch parallelism (`hpdl.parallel.branch.BranchParallel`): a block's branches on different ranks, like one process.

Three blocks, float64, SGD with momentum, 5 steps: an Inception-style block
(4 branches of different cost, concat along channels, placed by measured
cost), a ResNeXt-style grouped block (5 bottleneck paths, sum, and a mean
variant) with a residual around it, and a multi-head attention block (6
heads, concat along the last dimension). On 2, 3 and 4 ranks (branches not
divisible by ranks) the merged outputs, the gradient of the block's input
(summed over the ranks), every parameter's gradient and the parameters
after 5 steps equal one process within 1e-10. On 4 ranks: dp=2 x branch=2
with DataParallel, and a 2-stage Pipeline whose second stage holds the
block over a branch group of 2.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hpdl.parallel import DataParallel, Pipeline
from hpdl.parallel.branch import Branches, BranchParallel, assign

TOL, STEPS, ROWS = 1e-10, 5, 4


class Residual(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return x + self.block(x)


class Head(nn.Module):
    """One attention head with its own projections."""

    def __init__(self, d: int, dh: int):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, dh), nn.Linear(d, dh), nn.Linear(d, dh)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(1, 2) / self.q.out_features**0.5
        return torch.softmax(scores, -1) @ self.v(x)


class MeanTokens(nn.Module):
    def forward(self, x):
        return x.mean(1)


def conv(cin, cout, k):
    return nn.Conv2d(cin, cout, k, padding=k // 2)


def make(kind: str, comm=None, *, sample: bool = False) -> nn.Sequential:
    """The model with its block as BranchParallel over `comm`, or (comm None) the one-process reference."""
    torch.manual_seed(3)
    if kind == "inception":
        stem = [conv(2, 3, 3), nn.Tanh()]
        branches = [conv(3, 4, 1), nn.Sequential(conv(3, 3, 1), nn.Tanh(), conv(3, 6, 3)),
                    nn.Sequential(conv(3, 2, 1), nn.Tanh(), conv(2, 4, 5)),
                    nn.Sequential(nn.MaxPool2d(3, 1, 1), conv(3, 3, 1))]  # fmt: skip
        merge, dim, shape = "concat", 1, (2, 3, 6, 6)
        head = [nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(17, 3)]
    elif kind.startswith("resnext"):
        stem = [conv(2, 4, 3), nn.Tanh()]
        branches = [nn.Sequential(conv(4, 2, 1), nn.Tanh(), conv(2, 2, 3), nn.Tanh(), conv(2, 4, 1)) for _ in range(5)]
        merge, dim, shape = ("mean" if kind.endswith("mean") else "sum"), 1, (2, 4, 5, 5)
        head = [nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)]
    else:  # multi-head
        stem = [nn.Linear(4, 8), nn.Tanh()]
        branches = [Head(8, 3) for _ in range(6)]
        merge, dim, shape = "concat", -1, (2, 5, 8)
        head = [nn.Linear(18, 8), nn.Tanh(), MeanTokens(), nn.Linear(8, 3)]
    for module in (*stem, *branches, *head):
        module.double()
    if comm is None:
        block: nn.Module = Branches(branches, merge, dim=dim)  # the reference: every branch in one process
    else:
        probe = torch.randn(*shape, dtype=torch.float64) if sample else None
        block = BranchParallel(nn.ModuleList(branches), merge, comm, dim=dim, sample=probe)
    if kind.startswith("resnext"):
        block = Residual(block)
    return nn.Sequential(*stem, block, *head)


def make_data(kind: str, rows: int = ROWS):
    g = torch.Generator().manual_seed(11)
    shape = (rows, 5, 4) if kind == "heads" else (rows, 2, 6, 6) if kind == "inception" else (rows, 2, 5, 5)
    xs = torch.randn(STEPS, *shape, generator=g, dtype=torch.float64)
    ys = torch.randn(STEPS, rows, 3, generator=g, dtype=torch.float64)
    return xs, ys


def reference_name(model: nn.Module, name: str) -> str:
    """A BranchParallel keeps only its own branches: map `branches.j` back to the block's branch index."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part == "branches":
            owner = model.get_submodule(".".join(parts[:i]))
            if isinstance(owner, BranchParallel):
                parts[i + 1] = str(owner.owned[int(parts[i + 1])])
    return ".".join(parts)


def named(model: nn.Module, what: str) -> dict:
    out = {}
    for n, p in model.named_parameters():
        value = p.grad if what == "grad" else p
        out[reference_name(model, n)] = None if value is None else value.detach().clone()
    return out


def train(model: nn.Module, xs, ys, part=slice(None)) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out: dict = {}
    for s in range(STEPS):
        opt.zero_grad()
        x = xs[s][part].clone().requires_grad_(True)
        y_hat = model(x)
        loss = nn.functional.mse_loss(y_hat, ys[s][part])
        loss.backward()
        if s == 0:
            out.update(output=y_hat.detach(), input_grad=x.grad.clone(), grads=named(model, "grad"))
        opt.step()
    out["params"] = named(model, "param")
    return out


def branch_body(comm, kinds: list[str]) -> list[dict]:
    results = []
    for kind in kinds:
        model = make(kind, comm, sample=kind == "inception")
        xs, ys = make_data(kind)
        got = train(model, xs, ys)
        block = next(m for m in model.modules() if isinstance(m, BranchParallel))
        got["placement"] = block.placement
        results.append(got)
    return results


def compare(results: list[list[dict]], kinds: list[str], *, part_of_rank=None) -> None:
    for index, kind in enumerate(kinds):
        want = train(make(kind), *make_data(kind))
        seen = set()
        for rank, per_rank in enumerate(results):
            got = per_rank[index]
            if part_of_rank is None:  # dp splits the batch: outputs and input gradients are per replica
                for key in ("output", "input_grad"):
                    err = float((got[key] - want[key]).abs().max())
                    assert err <= TOL, f"{kind} rank {rank} {key}: {err:.3g}"
                for name, grad in got["grads"].items():
                    err = float((grad - want["grads"][name]).abs().max())
                    assert err <= TOL, f"{kind} rank {rank} grad {name}: {err:.3g}"
            for name, value in got["params"].items():
                err = float((value - want["params"][name]).abs().max())
                assert err <= TOL, f"{kind} rank {rank} {name}: {err:.3g}"
                seen.add(name)
        assert seen == set(want["params"]), (kind, set(want["params"]) - seen)  # every branch lives somewhere


KINDS = ["inception", "resnext", "heads", "resnext-mean"]


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_branches_on_ranks_train_like_one_process(ranks, nprocs):
    results = ranks("mpi", nprocs).run(branch_body, KINDS, timeout=120)
    compare(results, KINDS)
    placements = [r[0]["placement"] for r in results]
    assert all(p == placements[0] for p in placements)  # measured costs averaged: one placement everywhere
    assert sorted(set(placements[0])) == list(range(nprocs))


def composed_body(comm, layout: str) -> dict:
    """4 ranks: dp=2 x branch=2 (DataParallel around the model), or pp=2 x branch=2 (the block in stage 1)."""
    outer, inner = comm.rank // 2, comm.rank % 2
    if layout == "dp":
        branch = comm.split(outer, key=inner)
        dp = comm.split(inner, key=outer)
        model = DataParallel(make("inception", branch), dp)
        xs, ys = make_data("inception")
        rows = ROWS // 2
        got = train(model, xs, ys, slice(outer * rows, (outer + 1) * rows))
        got["params"] = {k.removeprefix("module."): v for k, v in got["params"].items()}
        for group in (branch, dp):
            group.close()
        return got
    pp = comm.split(outer, key=inner)  # ranks {0,1} and {2,3}: two pipelines, stage = inner
    branch = comm.split(inner, key=outer)  # the ranks of one stage
    model = make("inception", branch)
    xs, ys = make_data("inception")
    with Pipeline(model, pp, chunks=2, balance=[2, 5], schedule="1f1b", checkpoint="except_last") as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        for s in range(STEPS):
            opt.zero_grad()
            pipe.step(xs[s], ys[s], nn.functional.mse_loss)
            opt.step()
        params = {}
        for n, p in pipe.layers.named_parameters():
            index, rest = n.split(".", 1)
            params[reference_name(model, f"{pipe.first_layer + int(index)}.{rest}")] = p.detach().clone()
    for group in (pp, branch):
        group.close()
    return {"params": params}


@pytest.mark.parametrize("layout", ["dp", "pipeline"])
def test_branch_parallel_composes_with_data_parallel_and_pipeline_stages(ranks, layout):
    results = ranks("mpi", 4).run(composed_body, layout, timeout=120)
    compare([[r] for r in results], ["inception"], part_of_rank=True)


def test_dependent_branches_and_bad_placements_are_clear_errors():
    from hpdl.comm.self_backend import SelfCommunicator

    comm = SelfCommunicator(timeout=5.0, debug=False)
    shared = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="branches 0 and 1 share"):
        BranchParallel([nn.Sequential(shared, nn.Tanh()), nn.Sequential(nn.Tanh(), shared)], "sum", comm)
    with pytest.raises(ValueError, match="merge='max'"):
        BranchParallel([nn.Linear(3, 3)], "max", comm)
    with pytest.raises(ValueError, match="cannot keep 3 ranks busy"):
        assign([1.0, 2.0], 3)
    assert assign([5.0, 1.0, 1.0, 3.0], 3) == [0, 2, 2, 1]  # longest first onto the least loaded rank
    block = BranchParallel([nn.Linear(3, 2), nn.Linear(3, 4)], "sum", comm)
    with pytest.raises(ValueError, match="one shape"):
        block(torch.randn(2, 3))


def mixed_dtype_body(comm) -> tuple:
    """Under autocast a convolution branch gives bfloat16 and a pooling branch float32: the concat of one process
    promotes to float32, and so must the merge (found in review: it took the first output's dtype). Rank 0 owns
    the two pooling branches, whose dtype autocast does not change: a first call without autocast must not leave
    it a layout the others no longer use (found in review: the layout's key held this rank's output dtypes)."""

    def branches() -> list:
        torch.manual_seed(0)
        return [nn.MaxPool2d(3, 1, 1), nn.AvgPool2d(3, 1, 1), nn.Conv2d(3, 2, 1), nn.Conv2d(3, 4, 1)]

    x = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    one, spread = Branches(branches(), "concat"), BranchParallel(nn.ModuleList(branches()), "concat", comm,
                                                                 placement=[0, 0, 1, 1])  # fmt: skip
    plain = float((spread(x) - one(x)).abs().max())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = one(x), spread(x)
    want.square().sum().backward()
    got.square().sum().backward()
    mine = [i for i, r in enumerate(spread.placement) if r == comm.rank]
    grads = [
        float((a.grad - b.grad).abs().max())
        for i in mine
        for a, b in zip(spread.branches[mine.index(i)].parameters(), one.branches[i].parameters())
    ]
    return str(want.dtype), str(got.dtype), float((got.float() - want.float()).abs().max()), grads, plain


def test_the_concat_merge_promotes_mixed_dtypes_as_one_process_does(ranks):
    for rank, (want, got, err, grads, plain) in enumerate(ranks("mpi", 2).run(mixed_dtype_body)):
        assert want == got == "torch.float32" and err == 0.0 and plain == 0.0
        assert max(grads, default=0.0) == 0.0 and (grads or rank == 0), grads
