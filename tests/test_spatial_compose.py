"""Spatial parallelism composed: filter/channel-parallel convs, dp x sp, a spatial pipeline stage, checkpoints.

Each is checked against one process on the whole batch and image (float64, 1e-10).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hpdl.checkpoint
from hpdl.checkpoint.format import read_metadata
from hpdl.parallel import Mesh, Pipeline, Plan, build
from hpdl.parallel.mesh import full_state
from hpdl.parallel.mesh import state as mesh_state
from hpdl.parallel.spatial import ChannelParallelConv, FilterParallelConv, SpatialParallel, shard
from hpdl.parallel.tensor import full_state_dict
from hpdl.parallel.tensor.styles import split_problem
from spatial_models import make_data, make_net, train

TOL = 1e-10


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def assert_state(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name, v in want.items():
        assert close(got[name], v) <= TOL, f"{what}: {name}"


# ---------------------------------------------------------------------- filter / channel parallel
def channel_net() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(6, 4, 3, padding=2, dilation=2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
    ).double()  # fmt: skip


CONV_TP_PLAN = {"0": "filter", "2": "channel", "4": "filter_gather"}


def channel_train(comm, how):
    net = channel_net()
    # the first conv's filters split, the second's input channels split (no communication in between),
    # the third's filters split again and gathered
    if how == "by hand":
        net[0] = FilterParallelConv(net[0], comm)
        net[2] = ChannelParallelConv(net[2], comm)
        net[4] = FilterParallelConv(net[4], comm, gather_output=True)
    else:  # the same as tensor-parallel styles of a plan
        plan = Plan(tp=2, dp=1, tp_plan=CONV_TP_PLAN)
        mesh = Mesh.from_plan(comm, plan)
        net, _ = build(net, mesh, plan)  # dp=1: the parallelized model itself
        kinds = [type(net[i]).__name__ for i in (0, 2, 4)]
        assert kinds == ["FilterParallelConv", "ChannelParallelConv", "FilterParallelConv"], kinds
    x, y = make_data((9, 8))
    got = train(net, x, y, "adam")
    local_grads = {n: p.grad for n, p in net.named_parameters()}
    got["full_state"] = full_state_dict(net, comm)
    got["local"] = {n: t.shape for n, t in local_grads.items()}
    return got


def test_a_convolution_that_cannot_be_split_in_a_style_is_named_with_the_reason():
    assert split_problem(nn.Conv2d(3, 4, 3), "channel", 2) == "in_channels (3) does not divide by 2"
    assert split_problem(nn.Conv2d(4, 4, 3, groups=2), "filter", 2).startswith("groups=2")
    assert split_problem(nn.Conv2d(4, 4, 3, padding_mode="reflect"), "filter", 2).startswith("padding_mode='reflect'")
    assert "for a convolution: 'filter' / 'channel'" in split_problem(nn.Conv2d(4, 4, 3), "column", 2)
    assert "splits an nn.Conv1d/2d/3d" in split_problem(nn.Linear(4, 4), "filter", 2)
    assert split_problem(nn.Conv3d(4, 6, 3), "filter_gather", 2) == ""


@pytest.mark.parametrize("how", ["by hand", "from a plan"])
def test_filter_and_channel_parallel_convs_train_like_the_plain_convs(ranks, how):
    x, y = make_data((9, 8))
    want = train(channel_net(), x, y, "adam")
    for rank, got in enumerate(ranks("mpi", 2).run(channel_train, how, timeout=120)):
        assert close(got["logits"], want["logits"]) <= TOL, rank
        assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) <= TOL, rank
        assert close(got["input_grad"], want["input_grad"]) <= TOL, rank
        assert got["local"]["0.weight"] == (2, 2, 3, 3) and got["local"]["2.weight"] == (6, 2, 3, 3)
        assert_state(got["full_state"], want["state"], f"rank {rank}")


# ---------------------------------------------------------------------- dp x sp
def make_data4(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two make_data batches side by side: 4 samples per step, dp rank d trains on samples 2d and 2d+1."""
    x, y = make_data(shape)
    g = torch.Generator().manual_seed(11)
    return torch.cat([x, torch.randn(x.shape, generator=g, dtype=x.dtype)], 1), torch.cat([y, y.flip(1)], 1)


def dp_sp_train(comm):
    sp = comm.split(comm.rank // 2, comm.rank)  # ranks {0,1} split one image, ranks {2,3} the other
    dp = comm.rank // 2
    x, y = make_data4((23, 7))
    model = SpatialParallel(make_net(2, batch_norm=False), sp, dim=2, grad_comm=comm)
    got = train(model, x[:, 2 * dp : 2 * dp + 2], y[:, 2 * dp : 2 * dp + 2], "sgd", prepare=lambda t: shard(t, sp, 2))
    return {k.removeprefix("module."): v for k, v in got["state"].items()}


def test_sample_and_spatial_parallel_dp2_sp2_equals_one_process_on_the_whole_batch(ranks):
    x, y = make_data4((23, 7))
    want = train(make_net(2, batch_norm=False), x, y, "sgd")
    for rank, state in enumerate(ranks("mpi", 4).run(dp_sp_train, timeout=120)):
        assert_state(state, want["state"], f"rank {rank}")


def dp_sp_from_a_plan(comm, path: str):
    """The same dp2 x sp2 training, built by hpdl.parallel.build from a plan (sp innermost: {0,1} and {2,3});
    its mesh checkpoint loads into a plain model (the plain names, one copy of each weight)."""
    plan = Plan(dp=2, sp=2)
    mesh = Mesh.from_plan(comm, plan)
    model, _ = build(make_net(2, batch_norm=False), mesh, plan)
    dp, sp = mesh.coordinates()["dp"], mesh.sp
    x, y = make_data4((23, 7))
    got = train(model, x[:, 2 * dp : 2 * dp + 2], y[:, 2 * dp : 2 * dp + 2], "sgd", prepare=lambda t: shard(t, sp, 2))
    full = full_state(model, None, mesh)["model"]  # the plain model's names, from the mesh's view
    assert all(torch.equal(full[k], v) for k, v in model.module.state_dict().items()) and full.keys() == set(
        model.module.state_dict()
    )
    mesh_state.save(path, model, None, mesh)
    chunks = {name: len(entry["chunks"]) for name, entry in read_metadata(path)["tensors"].items()}
    assert set(chunks.values()) == {1}, chunks  # one rank of the four wrote each weight
    plain = make_net(2, batch_norm=False)
    mesh_state.load(path, plain)
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in model.module.state_dict().items())
    groups = {
        "sp": mesh.sp.allgather(torch.tensor([comm.rank])).tolist(),
        "dp": mesh.dp.allgather(torch.tensor([comm.rank])).tolist(),
        "dp x sp": mesh.group("sp", "dp").allgather(torch.tensor([comm.rank])).tolist(),
    }
    mesh.close()
    return {k.removeprefix("module."): v for k, v in got["state"].items()}, groups, type(model).__name__


def test_build_of_a_dp2_sp2_plan_equals_one_process_on_the_whole_batch(ranks, tmp_path):
    x, y = make_data4((23, 7))
    want = train(make_net(2, batch_norm=False), x, y, "sgd")
    results = ranks("mpi", 4).run(dp_sp_from_a_plan, str(tmp_path / "ckpt"), timeout=120)
    for rank, (state, groups, kind) in enumerate(results):
        assert kind == "SpatialParallel"
        assert groups == {
            "sp": [rank - rank % 2, rank - rank % 2 + 1],
            "dp": [rank % 2, rank % 2 + 2],
            "dp x sp": [0, 1, 2, 3],
        }
        assert_state(state, want["state"], f"rank {rank}")


def grid_from_a_plan(comm, path: str):
    """A plan file with 2 x 2 blocks (spatial_dim = [2, 3]) read back and built: one process's training."""
    path = f"{path}.{comm.rank}.toml"  # a file per rank: no rank reads another's half-written one
    Plan(sp=4, dp=1, spatial_dim=[2, 3], spatial_grid=[2, 2]).to_file(path)
    plan = Plan.from_file(path)
    mesh = Mesh.from_plan(comm, plan)
    model, _ = build(make_net(2), mesh, plan)
    x, y = make_data((23, 21))
    got = train(model, x, y, "adam", prepare=model.shard)
    grid = model.grid
    mesh.close()
    return {k.removeprefix("module."): v for k, v in got["state"].items()}, grid


def test_build_of_a_plan_with_a_grid_of_blocks_equals_one_process(ranks, tmp_path):
    x, y = make_data((23, 21))
    want = train(make_net(2), x, y, "adam")
    for rank, (state, grid) in enumerate(ranks("mpi", 4).run(grid_from_a_plan, str(tmp_path / "plan"))):
        assert grid == (2, 2)
        assert_state(state, want["state"], f"rank {rank}")


# ---------------------------------------------------------------------- spatial stage in a pipeline
FIRST_STAGE = 5


def spatial_pipeline_train(comm):
    """Ranks 0 and 1 run stage 0 spatially (each with its slab); ranks 2 and 3 each run stage 1 whole."""
    sp = comm.split(0 if comm.rank < 2 else 1, comm.rank)
    pipe_comm = comm.split(comm.rank % 2, comm.rank)  # pipelines {0, 2} and {1, 3}
    first = comm.rank < 2

    def wrap(stage: nn.Module) -> nn.Module:
        return SpatialParallel(stage, sp, dim=2, gather_output=True) if first else stage

    pipe = Pipeline(
        make_net(2, batch_norm=False),
        pipe_comm,
        chunks=2,
        balance=[FIRST_STAGE, 10],
        checkpoint="never",
        wrap_stage=wrap,
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    x, y = make_data((23, 7))
    losses = []
    for step in range(x.shape[0]):
        opt.zero_grad()
        loss = pipe.step(shard(x[step], sp, 2) if first else None, None if first else y[step], F.cross_entropy)
        opt.step()
        losses.append(float(loss))
    offset = pipe.first_layer
    state = {}
    for name, v in pipe.layers.state_dict().items():
        index, rest = name.split(".", 1)
        state[f"{int(index) + offset}.{rest}"] = v.clone()
    pipe.close()
    return state, losses


def spatial_pipeline_from_a_plan(comm, path: str):
    """The same layout from Plan(sp=2, pp=2): build puts the first stage in SpatialParallel over mesh.sp; its
    mesh checkpoint loads into the plain model."""
    plan = Plan(dp=1, sp=2, pp=2, micro_batches=2, balance=[FIRST_STAGE, 10], spatial_stages=1)
    mesh = Mesh.from_plan(comm, plan)
    pipe, opt = build(make_net(2, batch_norm=False), mesh, plan, optimizer=torch.optim.SGD, lr=0.1, momentum=0.9)
    first = pipe.is_first
    x, y = make_data((23, 7))
    losses = []
    for step in range(x.shape[0]):
        opt.zero_grad()
        loss = pipe.step(pipe.module.shard(x[step]) if first else None, None if first else y[step], F.cross_entropy)
        opt.step()
        losses.append(float(loss))
    mesh_state.save(path, pipe, opt, mesh)
    plain = make_net(2, batch_norm=False)
    mesh_state.load(path, plain)
    kind = type(pipe.module).__name__
    pipe.close()
    mesh.close()
    return {k: v.clone() for k, v in plain.state_dict().items()}, losses, kind


@pytest.mark.parametrize("how", ["by hand", "from a plan"])
def test_a_pipeline_whose_first_stage_is_spatial_over_two_ranks_equals_one_process(ranks, how, tmp_path):
    x, y = make_data((23, 7))
    want = train(make_net(2, batch_norm=False), x, y, "sgd")
    if how == "by hand":
        results = ranks("mpi", 4).run(spatial_pipeline_train, timeout=120)
    else:
        results = ranks("mpi", 4).run(spatial_pipeline_from_a_plan, str(tmp_path / "ckpt"), timeout=120)
    for rank, (state, losses, *kind) in enumerate(results):
        assert max(abs(a - b) for a, b in zip(losses, want["losses"])) <= TOL, rank
        if how == "by hand":
            expected = {k: v for k, v in want["state"].items() if (int(k.split(".")[0]) < FIRST_STAGE) == (rank < 2)}
        else:  # the whole model, loaded from the checkpoint the four ranks wrote
            expected = want["state"]
            assert kind == ["SpatialParallel" if rank < 2 else "Sequential"], rank
        assert_state(state, expected, f"rank {rank}")


# ---------------------------------------------------------------------- checkpoints
def spatial_checkpoint(comm, path):
    x, y = make_data((19, 6))
    model = SpatialParallel(make_net(2), comm, dim=2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(2):
        opt.zero_grad()
        F.cross_entropy(model(shard(x[step], comm, 2)), y[step]).backward()
        opt.step()
    hpdl.checkpoint.save(path, model, opt)
    fresh = SpatialParallel(make_net(2), comm, dim=2)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    hpdl.checkpoint.load(path, fresh, fresh_opt)
    for step in (2, 3):  # both continue identically
        for m, o in ((model, opt), (fresh, fresh_opt)):
            o.zero_grad()
            F.cross_entropy(m(shard(x[step], comm, 2)), y[step]).backward()
            o.step()
    return {k: v.clone() for k, v in model.module.state_dict().items()}, {
        k: v.clone() for k, v in fresh.module.state_dict().items()
    }


def test_a_spatial_model_saves_and_loads_through_hpdl_checkpoint(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    results = ranks("mpi", 2).run(spatial_checkpoint, path, timeout=120)
    exported = hpdl.checkpoint.export(path, str(tmp_path / "model.pt"))
    plain = make_net(2)
    plain.load_state_dict(torch.load(str(tmp_path / "model.pt"), weights_only=True))  # the plain model's names
    assert exported.keys() == plain.state_dict().keys()
    for rank, (trained, resumed) in enumerate(results):
        assert_state(resumed, trained, f"rank {rank}")
