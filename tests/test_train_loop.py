"""Trainer, checkpoints and clipping: errors that name the problem, and agreement across ranks."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hpdl.comm.self_backend import SelfCommunicator
from hpdl.train import (
    CheckpointError,
    DistributedSampler,
    NonFiniteLossError,
    Trainer,
    clip_grad_norm_,
    load,
    save,
)


def _net(hidden: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3))


def _data(n: int = 40, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


# ---------------------------------------------------------------- checkpoints
def test_checkpoint_round_trip(tmp_path):
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    path = str(tmp_path / "ck.pt")
    save(path, model, opt, epoch=3, step=17, extra={"note": "x", "values": [1.0, 2.0]})
    assert os.listdir(tmp_path) == ["ck.pt"], "no temporary file is left behind"
    fresh = _net(8)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    opt2 = torch.optim.Adam(fresh.parameters(), lr=0.01)
    state = load(path, fresh, opt2)
    assert (state.epoch, state.step, state.extra["note"]) == (3, 17, "x")
    for a, b in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(a, b)
    assert opt2.state_dict()["state"][0]["step"] == 1


def test_truncated_and_corrupt_checkpoints_are_clear_errors(tmp_path):
    model = _net()
    path = str(tmp_path / "ck.pt")
    save(path, model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = open(path, "rb").read()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"truncated\.pt .*truncated or corrupt"):
        load(str(truncated), _net())
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00not a checkpoint" * 50)
    with pytest.raises(CheckpointError, match=r"garbage\.pt .*cannot be read"):
        load(str(garbage), _net())
    corrupt = bytearray(data)
    start = len(corrupt) // 3
    corrupt[start : start + 64] = os.urandom(64)
    bad = tmp_path / "corrupt.pt"
    bad.write_bytes(bytes(corrupt))
    with pytest.raises(CheckpointError, match=r"corrupt\.pt"):
        load(str(bad), _net())
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, str(other))
    with pytest.raises(CheckpointError, match=r"other\.pt is not an hpdl checkpoint"):
        load(str(other), _net())
    with pytest.raises(CheckpointError, match="no such file"):
        load(str(tmp_path / "missing.pt"), _net())


def test_mismatched_checkpoint_names_the_tensors(tmp_path):
    path = str(tmp_path / "ck.pt")
    save(path, _net(8))
    with pytest.raises(CheckpointError) as info:
        load(path, _net(16))
    text = str(info.value)
    assert "ck.pt does not fit this model" in text
    assert "0.weight has shape (8, 4) in the checkpoint but (16, 4) in the model" in text
    assert "2.weight has shape (3, 8)" in text
    deeper = torch.nn.Sequential(*_net(8), torch.nn.Linear(3, 3))
    with pytest.raises(CheckpointError, match=r"3\.weight is in the model but not in the checkpoint"):
        load(path, deeper)
    model = _net(8)
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load(path, model, torch.optim.SGD(model.parameters(), lr=0.1))


# ---------------------------------------------------------------- non-finite loss
def test_non_finite_loss_stops_with_step_and_advice(tmp_path):
    data = _data(40)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=False))
    trainer = Trainer(model, opt, progress=False, checkpoint=str(tmp_path / "ck.pt"))
    trainer.fit(loader, 1)
    data.tensors[0][27] = float("nan")  # sample 27: the 4th batch of 8 without shuffling
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteLossError) as info:
        trainer.fit(loader, 2)
    error = info.value
    assert (error.epoch, error.step, error.global_step, error.ranks) == (1, 3, 8, (0,))
    text = str(error)
    assert "epoch 2, step 4 of the epoch (global step 9)" in text
    assert "rank 0: nan" in text and "lower learning rate" in text and "max_grad_norm" in text
    assert "ck.pt" in text
    for a, b in zip(before, model.parameters()):
        assert not torch.equal(a, b), "the three good steps of epoch 2 ran"
        assert torch.isfinite(b).all(), "the bad step never reached the model"
    assert len(trainer.history.losses) == 8 and all(math.isfinite(x) for x in trainer.history.losses)


def test_fp16_on_cpu_is_refused_with_a_fix():
    model = _net()
    with pytest.raises(ValueError, match="precision='bf16'"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16")


def test_bf16_autocast_trains(tmp_path):
    data = _data(64)
    model = _net()
    loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=1))
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.02), precision="bf16", progress=False)
    history = trainer.fit(loader, 5, eval_loader=DataLoader(data, batch_size=64))
    assert history.losses[-1] < history.losses[0]
    assert history.epochs[-1]["eval_accuracy"] is not None and history.epochs[-1]["eval_samples"] == 64


def test_timeline_records_spans(tmp_path):
    data = _data(32)
    model = _net()
    comm = SelfCommunicator(timeout=30.0, debug=False)
    path = str(tmp_path / "trace.json")
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, comm))
    Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, timeline=path, progress=False).fit(loader, 1)
    import json

    names = [e["name"] for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    assert names.count("forward") == 4 and names.count("backward") == 4 and names.count("optimizer") == 4


# ---------------------------------------------------------------- on 2 ranks
def clip_sharded_body(comm):
    """Each rank holds half of the parameters (as under ZeRO); the norm must be the global one."""
    torch.manual_seed(2)
    grads = [torch.randn(6, 3), torch.randn(5), torch.randn(4, 4), torch.randn(2)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    mine = params[comm.rank :: comm.size]
    norm = clip_grad_norm_(mine, 1.0, comm=comm)
    return float(norm), [p.grad for p in mine]


def clip_data_parallel_body(comm):
    """DataParallel averages the gradients; clipping them then gives the same norm and update everywhere."""
    from hpdl.parallel import DataParallel

    model = DataParallel(_net(), comm)
    g = torch.Generator().manual_seed(10 + comm.rank)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    norm = clip_grad_norm_(model.parameters(), 0.1)
    return float(norm), [p.grad.clone() for p in model.parameters()]


def non_finite_body(comm):
    """A NaN on rank 1 only: every rank stops with the same error, none waits in the next collective."""
    from hpdl.parallel import DataParallel

    data = _data(32)
    if comm.rank == 1:
        data.tensors[0][:] = float("nan")
    model = DataParallel(_net(), comm)
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(len(data), comm, rank=0, size=1))
    try:
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), comm=comm, progress=False).fit(loader, 1)
    except NonFiniteLossError as error:
        return error.ranks, str(error)
    return None


def test_clipping_is_global_on_two_ranks(ranks):
    pool = ranks("mpi", 2)
    results = pool.run(clip_sharded_body)
    torch.manual_seed(2)
    grads = [torch.randn(6, 3), torch.randn(5), torch.randn(4, 4), torch.randn(2)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    expected = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
    assert [r[0] for r in results] == pytest.approx([expected, expected], rel=1e-6)
    clipped = results[0][1][0::1]
    for got, want in zip(clipped + results[1][1], params[0::2] + params[1::2]):
        torch.testing.assert_close(got, want.grad)
    same = pool.run(clip_data_parallel_body)
    assert same[0][0] == same[1][0]
    for a, b in zip(same[0][1], same[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_non_finite_loss_on_one_rank_stops_both(ranks):
    results = ranks("mpi", 2).run(non_finite_body, timeout=60)
    for bad, text in results:
        assert bad == (1,)
        assert "rank 1: nan" in text and "epoch 1, step 1 of the epoch" in text


def test_trainer_clips_zero_sharded_gradients_like_a_plain_model():
    """ZeRO-2 keeps gradients in its shards (no .grad): the Trainer clips through the optimizer's own global norm."""
    from hpdl.parallel import zero

    comm = SelfCommunicator(timeout=30.0, debug=False)
    loader = DataLoader(_data(), batch_size=8)
    plain = _net()
    Trainer(plain, torch.optim.SGD(plain.parameters(), lr=0.5), comm=comm, max_grad_norm=0.01, progress=False).fit(
        loader, 1
    )
    sharded, opt = zero(_net(), comm, stage=2, optimizer=torch.optim.SGD, lr=0.5)
    Trainer(sharded, opt, comm=comm, max_grad_norm=0.01, progress=False).fit(loader, 1)
    unclipped = _net()
    Trainer(unclipped, torch.optim.SGD(unclipped.parameters(), lr=0.5), comm=comm, progress=False).fit(loader, 1)
    full = sharded.full_parameters()
    for name, value in plain.named_parameters():
        torch.testing.assert_close(full[name], value.detach())
    assert any(not torch.allclose(a, c) for a, c in zip(plain.parameters(), unclipped.parameters()))
