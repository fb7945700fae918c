"""Tensor parallelism: N ranks splitting every layer train like one process holding the whole model.

Tolerances: float64 models, where tp changes only the order of sums (the
row-parallel allreduce, the vocabulary-parallel softmax), agree with one
process to 1e-9 after 5 AdamW steps (the issue asks for 1e-5).
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpdl.models.gpt import GPT, GPTConfig, lm_loss
from hpdl.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPShard,
    full_state_dict,
    parallelize,
    vocab_parallel_cross_entropy,
)

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=4, n_embd=16)
STEPS, BATCH, LR = 5, 8, 1e-2
TOL = 1e-9


def make_data(steps: int = STEPS, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids x[step] (batch, time) and next-token targets; the same on every rank and in the reference."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, CONFIG.vocab_size, (steps, batch, CONFIG.block_size + 1), generator=g)
    return ids[..., :-1].contiguous(), ids[..., 1:].contiguous()


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG).double()


def train_reference(steps: int = STEPS, clip: Optional[float] = None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, the whole batch: the parameters after `steps` AdamW steps and the loss of each step."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = make_data()
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = lm_loss(model(x[step]), y[step])
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def assert_same_parameters(got: dict, want: dict, tol: float, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    for name, value in want.items():
        err = float((got[name].double() - value.double()).abs().max())
        assert err <= tol, f"{what}: {name}: max |diff| {err:.3g} > {tol}"


# ---------------------------------------------------------------------- one process
def test_tp_shard_pieces_of_a_fused_qkv_weight():
    shard = TPShard((12, 5), 0, rank=1, size=2, parts=3)
    full = torch.arange(60.0).view(12, 5)
    local = shard.take(full)
    assert local.shape == shard.local_shape == (6, 5)
    # rank 1 holds the second half of each block of 4 rows: rows 2-3, 6-7, 10-11
    assert torch.equal(local, full[[2, 3, 6, 7, 10, 11]])
    assert shard.boxes() == [((2, 0), (2, 5)), ((6, 0), (2, 5)), ((10, 0), (2, 5))]
    other = TPShard((12, 5), 0, rank=0, size=2, parts=3).take(full)
    assert torch.equal(shard.assemble([other, local]), full)
    with pytest.raises(ValueError, match="does not split"):
        TPShard((10, 5), 0, rank=0, size=2, parts=3)


def test_parallelize_rejects_bad_plans_before_touching_the_model(ranks):
    pool = ranks("self")
    errors = pool.run(parallelize_errors)[0]
    assert "matches no module" in errors["nomatch"]
    assert "cannot split block0.ln1 as 'column'" in errors["style_on_wrong_module"]
    assert "unknown style 'diagonal'" in errors["unknown_style"]
    assert "no layers to split" in errors["no_plan"]
    assert "shares a parameter with embed.tok.weight, head.proj.weight (tied weights)" in errors["tied"]


def parallelize_errors(comm) -> dict[str, str]:
    out = {}
    cases = {
        "nomatch": (make_model(), {"*.nothing": "row"}),
        "style_on_wrong_module": (make_model(), {"*.ln1": "column"}),
        "unknown_style": (make_model(), {"*.mlp.fc": "diagonal"}),
        "no_plan": (nn.Sequential(nn.Linear(4, 4)), None),
        "tied": (_tied(), {"embed.tok": "vocab"}),
    }
    for name, (model, plan) in cases.items():
        try:
            parallelize(model, comm, plan)
        except (ValueError, TypeError) as exc:
            out[name] = str(exc)
        else:
            out[name] = "no error"
    return out


def _tied() -> GPT:
    model = make_model()
    model.get_submodule("head.proj").weight = model.get_submodule("embed.tok").weight
    return model


# ---------------------------------------------------------------------- several ranks
def cross_entropy_body(comm) -> dict:
    """Vocabulary-parallel cross-entropy on this rank's slice against the plain one on the full logits."""
    g = torch.Generator().manual_seed(5)
    vocab = 12 * comm.size
    logits = torch.randn(3, 7, vocab, generator=g, dtype=torch.float64) * 4
    target = torch.randint(0, vocab, (3, 7), generator=g)
    target[0, :4] = target[2, 6] = -100  # padding: no loss, no gradient, left out of the mean
    width = vocab // comm.size
    out = {}
    for reduction in ("mean", "sum", "none"):
        full = logits.clone().requires_grad_()
        want = F.cross_entropy(full.reshape(-1, vocab), target.reshape(-1), reduction=reduction)
        if reduction == "none":
            want = want.reshape(target.shape)
        (want * torch.arange(1, want.numel() + 1, dtype=want.dtype).view_as(want)).sum().backward()
        mine = logits[..., comm.rank * width : (comm.rank + 1) * width].clone().requires_grad_()
        got = vocab_parallel_cross_entropy(mine, target, comm, reduction=reduction)
        (got * torch.arange(1, got.numel() + 1, dtype=got.dtype).view_as(got)).sum().backward()
        out[reduction] = (
            float((got - want).abs().max()),
            float((mine.grad - full.grad[..., comm.rank * width : (comm.rank + 1) * width]).abs().max()),
        )
    errors = []
    for bad in (vocab, -1):  # out-of-range ids are an error, not a silent wrong loss
        wrong = target.clone()
        wrong[1, 2] = bad
        try:
            vocab_parallel_cross_entropy(logits[..., :width], wrong, comm)
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    return out


def linear_pair_body(comm) -> tuple[float, float, float]:
    """Column then row layer == the two plain linears: outputs and input gradients; a gathered column too."""
    torch.manual_seed(3)
    fc, proj = nn.Linear(6, 8 * comm.size).double(), nn.Linear(8 * comm.size, 5).double()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    want = proj(torch.tanh(fc(x)))
    want.square().sum().backward()
    col, row = ColumnParallelLinear.from_linear(fc, comm), RowParallelLinear.from_linear(proj, comm)
    x2 = x.detach().clone().requires_grad_()
    got = row(torch.tanh(col(x2)))
    got.square().sum().backward()
    assert x.grad is not None and x2.grad is not None
    gathered = ColumnParallelLinear.from_linear(fc, comm, gather_output=True)(x.detach())
    return (
        float((got - want).abs().max()),
        float((x2.grad - x.grad).abs().max()),
        float((gathered - fc(x.detach())).abs().max()),
    )


def train_tp_body(comm, steps: int = STEPS) -> tuple[dict, list[float]]:
    """Pure tensor parallelism over the whole world: every rank sees the whole batch."""
    model = parallelize(make_model(), comm)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = make_data()
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = vocab_parallel_cross_entropy(model(x[step]), y[step], comm)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return full_state_dict(model, comm), losses


def tp_bodies(comm) -> dict:
    return {"ce": cross_entropy_body(comm), "pair": linear_pair_body(comm), "train": train_tp_body(comm)}


@pytest.mark.parametrize(
    ("backend", "nprocs"), [("mpi", 2), ("mpi", 4), ("torch", 2)], ids=["mpi-2", "mpi-4", "torch-2"]
)
def test_tensor_parallel_equals_one_process(ranks, backend, nprocs):
    results = ranks(backend, nprocs).run(tp_bodies, timeout=120)
    want, want_losses = train_reference()
    for rank, result in enumerate(results):
        errors = result["ce"].pop("errors")
        assert len(errors) == 2 and all("outside the vocabulary" in e for e in errors), errors
        for reduction, (value_err, grad_err) in result["ce"].items():
            assert value_err <= 1e-12 and grad_err <= 1e-12, f"rank {rank} cross-entropy ({reduction})"
        assert max(result["pair"]) <= 1e-12, f"rank {rank} column/row pair: {result['pair']}"
        got, losses = result["train"]
        assert_same_parameters(got, want, TOL, f"tp={nprocs} rank {rank}")
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= TOL
