"""Branch parallelism through a `Plan` and the planner: a model written with `Branches` needs nothing else.

The planner profiles the `Branches` block as a "branch" unit (its parameters and FLOPs split over tp, one
merge forward and one input-gradient sum backward, at most one rank per branch) and, at a global batch of
1 (which data parallelism cannot split) on 2 devices, ranks branch parallelism (tp=2) above two pipeline
stages, and first when spatial parallelism (which splits the image instead) is left out. `Plan(tp=k)`
builds the same model with the block as `BranchParallel` over the mesh's tp group: on 2 and 3 ranks (4
branches: uneven on 3), dp x tp on 4, the parameters after 5 steps with the mesh's gradient clipping equal
one process (float64, 1e-10); a mesh checkpoint of such a model is a clear error.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hpdl.parallel.branch import Branches
from hpdl.plan import Cluster, Workload, search
from hpdl.plan.cluster import GB, Link
from hpdl.plan.profile import ProfileError, measure
from hpdl.plan.ranking import candidates

STEPS, TOL = 5, 1e-10


def conv(cin: int, cout: int, k: int) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, k, padding=k // 2)


def inception(width: int = 3) -> nn.Sequential:
    """A stem, one Inception-style block of 4 branches of different cost (concat: 4w+6w+4w+3w channels), a head."""
    torch.manual_seed(5)
    w = width
    block = Branches(
        [
            conv(w, 4 * w, 1),
            nn.Sequential(conv(w, 3 * w, 1), nn.Tanh(), conv(3 * w, 6 * w, 3)),
            nn.Sequential(conv(w, 2 * w, 1), nn.Tanh(), conv(2 * w, 4 * w, 5)),
            nn.Sequential(nn.MaxPool2d(3, 1, 1), conv(w, 3 * w, 1)),
        ],
        "concat",
    )
    return nn.Sequential(conv(2, w, 3), nn.Tanh(), block, nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(17 * w, 5))  # fmt: skip


def cluster() -> Cluster:
    return Cluster(name="two", nodes=1, devices_per_node=2, memory_bytes=8 * GB, flops={"fp32": 1e11},
                   intra=Link("shm", 2e-6, 10 * GB), inter=Link("net", 10e-6, 1 * GB))  # fmt: skip


def test_the_planner_profiles_a_branches_block_and_spreads_it_where_data_parallelism_cannot_split():
    model = inception(width=16)
    profile = measure(model, lambda b: torch.randn(b, 2, 32, 32), batch=2)
    layer = next(ly for ly in profile.layers if ly.name == "2")
    block = model[2]
    assert layer.tp_max == 4 and layer.tp_allreduce_fwd == 1 and layer.tp_allreduce_bwd == 1
    assert layer.tp_params == sum(p.numel() for p in block.parameters())
    assert layer.tp_flops == layer.flops > 0.5 * profile.flops  # the block is most of the model's compute
    assert all(ly.tp_flops == 0 for ly in profile.layers if ly.name != "2")

    every = search(profile, cluster(), Workload(batch=1, precision="fp32"))
    found = {(e.candidate.tp, e.candidate.pp, e.candidate.sp): e for e in every.feasible}
    assert found[(2, 1, 1)].step_s < found[(1, 2, 1)].step_s  # a batch of 1: two stages take turns
    result = search(profile, cluster(), Workload(batch=1, precision="fp32"), spatial=False)  # (sp splits the image)
    best = result.best
    assert best is not None and (best.candidate.dp, best.candidate.tp, best.candidate.pp) == (1, 2, 1), best
    plan = result.best_plan()
    assert plan.tp == 2 and plan.tp_plan_for(model) == {"2": "branch"}
    plan.validate(2, model)  # the block may be spread over 2 ranks

    from hpdl.parallel import Plan
    from hpdl.parallel.mesh.plan_config import PlanError

    with pytest.raises(PlanError, match="4 branches for 8 ranks"):
        Plan(tp=8).validate(8, model)
    with pytest.raises(PlanError, match=r"itself a Branches block.*nn.Sequential\(block\)"):
        Plan(tp=2).validate(2, model[2])
    with pytest.raises(PlanError, match="spreads an hpdl.parallel.branch.Branches block; this is a Conv2d"):
        Plan(tp=2, tp_plan={"0": "branch"}).validate(2, model)
    # found in review: a layer split over tp inside a spread block mixed other ranks' branches (silently)
    inside = {"2": "branch", "2.branches.0": "filter_gather"}
    with pytest.raises(PlanError, match=r"splits 2.branches.0 inside a 'branch' block"):
        Plan(tp=2, tp_plan=inside).validate(2, model)
    with pytest.raises(ProfileError, match=r"splits 2.branches.0 inside a 'branch' block"):
        measure(model, lambda b: torch.randn(b, 2, 32, 32), batch=2, tp_plan=inside)
    # and ZeRO's norm and checkpoints would count only tp rank 0's branches: refused, and never proposed
    with pytest.raises(PlanError, match="with zero_stage=1"):
        Plan(tp=2, zero_stage=1).validate(2, model)
    proposed = list(candidates(profile, cluster(), Workload(batch=2, precision="fp32")))
    assert not [c for c in proposed if c.tp > 1 and c.zero] and [c for c in proposed if c.tp > 1]


def test_the_cost_model_prices_the_busiest_rank_where_whole_branches_split_unevenly():
    """The block's four branches differ in cost: over 4 ranks the most expensive branch alone sets the pace,
    over 3 the rank given two; the profile prices the placement a Plan makes (by parameter count)."""
    from torch.utils.flop_counter import FlopCounterMode

    from hpdl.parallel.branch.placement import loads, place
    from hpdl.plan.cost import CostModel

    model = inception(width=16)
    profile = measure(model, lambda b: torch.randn(b, 2, 32, 32), batch=2)
    layer = next(ly for ly in profile.layers if ly.name == "2")
    block, x = model[2], model[1](model[0](torch.randn(2, 2, 32, 32)))
    flops, params = [], []
    for branch in block.branches:
        with FlopCounterMode(display=False) as counter:
            branch(x)
        flops.append(counter.get_total_flops() / 2)
        params.append(float(sum(p.numel() for p in branch.parameters())))
    assert sum(flops) == pytest.approx(layer.tp_flops)
    assert layer.tp_share(1) == 1.0 and layer.tp_param_share(1) == 1.0
    for tp in (2, 3, 4):
        owner = place(params, tp)
        busiest = max(loads(flops, owner, tp)) / sum(flops)
        assert layer.tp_share(tp) == pytest.approx(busiest) and busiest > 1 / tp + 0.02, (tp, owner, flops)
        assert layer.tp_param_share(tp) == pytest.approx(max(loads(params, owner, tp)) / sum(params))
    cost = CostModel(profile, cluster(), Workload(batch=1, precision="fp32"))
    rest = profile.flops - layer.flops
    assert cost.stages(1, 4)[0].flops == pytest.approx(rest + layer.flops * layer.tp_share(4))
    assert cost.stages(1, 4)[0].flops > rest + layer.flops / 4  # what an even split would have promised
    three = Cluster(name="three", nodes=1, devices_per_node=3, memory_bytes=8 * GB, flops={"fp32": 1e11},
                    intra=Link("shm", 2e-6, 10 * GB), inter=Link("net", 10e-6, 1 * GB))  # fmt: skip
    tps = {e.candidate.tp for e in search(profile, three, Workload(batch=1, precision="fp32")).feasible}
    assert tps == {1, 3}  # 4 branches on 3 ranks (one holds two): searched, and priced by its busiest rank


def test_a_unit_of_branches_and_attention_heads_needs_a_branch_per_rank_and_tp_dividing_the_heads():
    from hpdl.plan.profile import Layer

    unit = Layer("block", 10, 1.0, 1.0, 1.0, tp_max=4, tp_branches=4, tp_heads=6)
    assert [tp for tp in range(1, 9) if unit.tp_allows(tp)] == [1, 2, 3]  # 4 does not divide 6 heads
    assert [tp for tp in range(1, 9) if Layer("b", 10, 1.0, 1.0, 1.0, tp_max=4, tp_branches=4).tp_allows(tp)] == [
        1, 2, 3, 4,
    ]  # fmt: skip
    assert [tp for tp in range(1, 9) if Layer("attn", 10, 1.0, 1.0, 1.0, tp_max=6).tp_allows(tp)] == [1, 2, 3, 6]


def reference(batches: list[torch.Tensor], targets: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[float]]:
    """One process: the parameters after the steps, and the gradient norm before clipping at each step."""
    model = inception().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    norms = []
    for x, y in zip(batches, targets):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], norms


def data() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    batches = [torch.randn(4, 2, 8, 8, dtype=torch.float64, generator=generator) for _ in range(STEPS)]
    targets = [torch.randn(4, 5, dtype=torch.float64, generator=generator) for _ in range(STEPS)]
    return batches, targets


def planned_training(comm, tp: int):
    """Plan(dp=size/tp, tp=tp) built on a mesh, 5 steps with the mesh's clipping; every parameter gathered."""
    import hpdl.parallel as hp
    from hpdl.parallel.branch import BranchParallel
    from hpdl.parallel.mesh import state

    mesh = hp.Mesh(comm, dp=comm.size // tp, tp=tp)
    model, optimizer = hp.build(inception().double(), mesh, hp.Plan(dp=comm.size // tp, tp=tp),
                                optimizer=torch.optim.SGD, lr=0.05, momentum=0.9)  # fmt: skip
    plain = model.module if isinstance(model, hp.DataParallel) else model
    block = plain[2]
    assert isinstance(block, BranchParallel) and block.comm.size == tp
    batches, targets = data()
    per = 4 // mesh.dp.size
    norms = []
    for x, y in zip(batches, targets):
        rows = slice(mesh.dp.rank * per, (mesh.dp.rank + 1) * per)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        norms.append(float(hp.clip_grad_norm_(model, 0.5, mesh)))
        optimizer.step()
    # every parameter in the one-process order: the block's branches from the rank that owns each
    branch_params = {}
    for rank_branches in mesh.tp.allgather_object(
        {i: [p.detach() for p in b.parameters()] for i, b in zip(block.owned, block.branches)}
    ):
        branch_params.update(rank_branches)
    params = []
    for index, module in enumerate(plain):
        if index == 2:
            for i in range(block.count):
                params += branch_params[i]
        else:
            params += [p.detach() for p in module.parameters()]
    try:
        state.save("/nonexistent-hpdl-branch-checkpoint", model, optimizer, mesh)
        refused = ""
    except NotImplementedError as exc:
        refused = str(exc)
    return params, norms, refused


@pytest.mark.parametrize("nprocs, tp", [(2, 2), (3, 3), (4, 2)], ids=["tp2", "tp3-uneven", "dp2-tp2"])
def test_a_planned_branch_parallel_model_trains_like_one_process(ranks, nprocs, tp):
    expected, expected_norms = reference(*data())
    for params, norms, refused in ranks("mpi", nprocs).run(planned_training, tp, timeout=120):
        assert len(params) == len(expected)
        for got, want in zip(params, expected):
            assert torch.allclose(got, want, rtol=0, atol=TOL), (got - want).abs().max()
        assert norms == pytest.approx(expected_norms, rel=1e-10)
        assert "BranchParallel blocks" in refused and "tp=1" in refused
