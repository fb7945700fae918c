"""Sharded checkpoints: save on N ranks with one strategy, load on M with another, and train on identically.

The global batch (12 samples) is the same whatever the rank count (12 / N per
rank), so N ranks and one process follow the same trajectory in float64; a
run interrupted by save / load round trips must give the same losses as one
uninterrupted process (to 1e-10).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import hpdl
from hpdl.checkpoint import CheckpointError, CorruptShardError, MissingShardError
from hpdl.checkpoint.format import shard_name, write_metadata, write_shard
from hpdl.parallel import DataParallel
from hpdl.parallel.zero_redundancy import zero

DIN, HID, DOUT, GLOBAL = 5, 7, 3, 12
LR = 0.02


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIN, HID), nn.Tanh(), nn.Linear(HID, HID), nn.Tanh(), nn.Linear(HID, DOUT)).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(GLOBAL, DIN, generator=g, dtype=torch.float64), torch.randn(
        GLOBAL, DOUT, generator=g, dtype=torch.float64
    )


def segment(comm, cfg: dict) -> list[float]:
    """Build the layout `cfg["kind"]`, optionally load, train `steps` steps from `start`, optionally save."""
    kind = cfg["kind"]
    if kind == "zero":
        model, opt = zero(
            make_model(100 + comm.rank), comm, stage=cfg["stage"], bucket_mb=0.0002, wrap_policy=(nn.Linear,), lr=LR
        )
    elif kind == "dp":
        model = DataParallel(make_model(100 + comm.rank), comm, bucket_mb=0.0002)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        model = make_model(100)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ckpt_comm = None if kind == "plain" else comm
    if cfg.get("load"):
        extra = hpdl.checkpoint.load(cfg["load"], model, opt, comm=ckpt_comm)
        if extra.get("step") != cfg["start"]:
            raise AssertionError(f"checkpoint says step {extra.get('step')}, expected {cfg['start']}")
    per = GLOBAL // comm.size
    losses = []
    for step in range(cfg["start"], cfg["start"] + cfg["steps"]):
        x, y = batch(step)
        lo = comm.rank * per
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[lo : lo + per]), y[lo : lo + per])
        loss.backward()
        opt.step()
        mean = loss.detach().reshape(1).clone()
        comm.allreduce(mean, "avg")
        losses.append(float(mean))
    if cfg.get("save"):
        hpdl.checkpoint.save(cfg["save"], model, opt, comm=ckpt_comm, extra={"step": cfg["start"] + cfg["steps"]})
    return losses


def reference(steps: int) -> list[float]:
    model = make_model(100)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_round_trips_across_rank_counts_and_strategies(ranks, tmp_path):
    a, b, c, d = (str(tmp_path / name) for name in "abcd")
    losses = ranks("mpi", 2).run(segment, {"kind": "zero", "stage": 3, "start": 0, "steps": 2, "save": a})[0]
    losses += ranks("mpi", 4).run(segment, {"kind": "zero", "stage": 1, "start": 2, "steps": 2, "load": a, "save": b})[
        0
    ]
    losses += ranks("mpi", 2).run(segment, {"kind": "dp", "start": 4, "steps": 2, "load": b, "save": c})[0]
    losses += ranks("self").run(segment, {"kind": "plain", "start": 6, "steps": 2, "load": c, "save": d})[0]
    losses += ranks("mpi", 4).run(segment, {"kind": "zero", "stage": 2, "start": 8, "steps": 2, "load": d})[0]
    want = reference(10)
    assert losses == pytest.approx(want, rel=1e-10, abs=1e-12)
    # the saved layouts really differed: stage 3 on 2 ranks wrote two shards holding pieces, DataParallel one
    assert len([f for f in os.listdir(a) if f.startswith("shard-")]) == 2
    assert hpdl.checkpoint.ShardReader(c).metadata["layout"]["strategy"] == "DataParallel"


def test_four_ranks_to_one_and_export(ranks, tmp_path):
    path, out = str(tmp_path / "ckpt"), str(tmp_path / "model.pt")
    first = ranks("mpi", 4).run(segment, {"kind": "zero", "stage": 2, "start": 0, "steps": 3, "save": path})[0]
    rest = ranks("self").run(segment, {"kind": "plain", "start": 3, "steps": 2, "load": path})[0]
    assert first + rest == pytest.approx(reference(5), rel=1e-10, abs=1e-12)
    state = hpdl.checkpoint.export(path, out)
    plain = make_model(0)
    plain.load_state_dict(torch.load(out, weights_only=True))
    for name, value in plain.state_dict().items():
        assert torch.equal(value, state[name])
        assert torch.equal(value, hpdl.checkpoint.read_full_tensor(path, name))
    exp_avg = hpdl.checkpoint.read_full_tensor(path, "optim/0.weight/exp_avg")
    assert exp_avg.shape == (HID, DIN) and float(exp_avg.abs().sum()) > 0


def test_missing_or_corrupt_shard_is_named(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    ranks("mpi", 2).run(segment, {"kind": "zero", "stage": 2, "start": 0, "steps": 1, "save": path})
    shards = sorted(f for f in os.listdir(path) if f.startswith("shard-"))
    victim = os.path.join(path, shards[1])
    data = bytearray(open(victim, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    with pytest.raises(CorruptShardError, match=shards[1]):
        hpdl.checkpoint.load(path, make_model(0))
    os.remove(victim)
    with pytest.raises(MissingShardError, match=f"{shards[1]}.*rank 1"):
        hpdl.checkpoint.load(path, make_model(0))
    os.remove(os.path.join(path, "metadata.pt"))
    with pytest.raises(CheckpointError, match="did not finish"):
        hpdl.checkpoint.load(path, make_model(0))


def test_a_model_that_does_not_fit_is_refused(ranks, tmp_path):
    path = str(tmp_path / "ckpt")
    ranks("self").run(segment, {"kind": "plain", "start": 0, "steps": 1, "save": path})
    other = nn.Sequential(nn.Linear(DIN, HID + 1), nn.Tanh(), nn.Linear(HID + 1, DOUT)).double()
    with pytest.raises(CheckpointError, match=r"0.weight has shape \(7, 5\) in the checkpoint but \(8, 5\)"):
        hpdl.checkpoint.load(path, other)
    with pytest.raises(CheckpointError, match="SGD"):
        model = make_model(0)
        hpdl.checkpoint.load(path, model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_box_chunks_of_other_layouts(tmp_path):
    """A tensor-parallel style layout: a (4, 6) matrix in two column blocks of two files."""
    full = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    folder = str(tmp_path)
    files, chunks = {}, []
    for rank, (a, b) in enumerate([(0, 3), (3, 6)]):
        name = shard_name(rank, 2, "tp")
        files[name] = write_shard(folder, name, {"w": full[:, a:b].contiguous()}) | {"rank": rank}
        chunks.append({"file": name, "key": "w", "box": ((0, 4), (a, b))})
    tensors = {"model/w": {"shape": (4, 6), "dtype": "float32", "kind": "param", "chunks": chunks}}
    write_metadata(
        folder,
        {
            "world_size": 2,
            "layout": {"strategy": "tp"},
            "files": files,
            "tensors": tensors,
            "optimizer": None,
            "extra": {},
        },
    )
    assert torch.equal(hpdl.checkpoint.read_full_tensor(folder, "w"), full)
    reader = hpdl.checkpoint.ShardReader(folder)
    assert torch.equal(reader.read_flat("model/w", 5, 13), full.reshape(-1)[5:13])
    assert torch.equal(reader.read_box("model/w", [(1, 3), (2, 5)]), full[1:3, 2:5])


def test_a_zero_model_is_recognised_by_lookups_python_3_12_isinstance_would_miss():
    """From Python 3.12, isinstance on a runtime-checkable Protocol looks members up statically
    (inspect.getattr_static), which misses the submodule nn.Module keeps in `_modules`: every ZeRO checkpoint
    failed there ("a ZeroOptimizer is saved and loaded with the model it was built with"). The format asks with
    plain lookups instead; here on any Python."""
    import inspect

    from hpdl.checkpoint.sharded import _sharded_parts
    from hpdl.comm.self_backend import SelfCommunicator

    model, opt = zero(nn.Linear(4, 2), SelfCommunicator(timeout=30.0, debug=False), stage=3,
                      optimizer=torch.optim.SGD, lr=0.1)  # fmt: skip
    with pytest.raises(AttributeError):
        inspect.getattr_static(model, "module")  # what 3.12's isinstance sees
    assert _sharded_parts(model, opt) == (model, opt)
