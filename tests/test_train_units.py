"""hpdl.train in one process: sampler, LR schedule, LARS/LAMB against their formulas, clipping, progress."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from hpdl.train import LAMB, LARS, DistributedSampler, Progress, WarmupSchedule, clip_grad_norm_, linear_scaled_lr


# ---------------------------------------------------------------- sampler
@pytest.mark.parametrize("n, size", [(10, 3), (12, 4), (7, 2), (5, 1), (3, 4)])
def test_sampler_shards_partition_and_pad(n, size):
    shards = [DistributedSampler(n, rank=r, size=size, seed=3).shard() for r in range(size)]
    lengths = {len(s) for s in shards}
    assert lengths == {math.ceil(n / size)}, "padding gives every rank the same count"
    flat = [i for s in shards for i in s]
    assert set(flat) == set(range(n)), "every sample is used"
    assert len(flat) - n == (-n) % size, "exactly the padding is repeated"
    for r in range(size):
        assert len(DistributedSampler(n, rank=r, size=size)) == math.ceil(n / size)


def test_sampler_drop_last_and_exact_partition():
    n, size = 10, 3
    dropped = [DistributedSampler(n, rank=r, size=size, drop_last=True).shard() for r in range(size)]
    assert all(len(s) == 3 for s in dropped)
    flat = [i for s in dropped for i in s]
    assert len(set(flat)) == 9 and len(flat) == 9, "no repeats, the uneven tail is dropped"
    exact = [DistributedSampler(n, rank=r, size=size, shuffle=False, pad=False).shard() for r in range(size)]
    assert sorted(i for s in exact for i in s) == list(range(n))
    assert [len(s) for s in exact] == [4, 3, 3]
    with pytest.raises(ValueError, match="leaves every rank empty"):
        DistributedSampler(2, rank=0, size=3, drop_last=True)


def test_sampler_reshuffles_per_epoch_same_on_every_rank():
    a, b = DistributedSampler(100, rank=0, size=2, seed=1), DistributedSampler(100, rank=1, size=2, seed=1)
    first = (a.shard(), b.shard())
    assert not set(first[0]) & set(first[1]), "the shards of one epoch are disjoint"
    a.set_epoch(1)
    b.set_epoch(1)
    second = (a.shard(), b.shard())
    assert second[0] != first[0], "a new epoch is a new order"
    assert sorted(second[0] + second[1]) == list(range(100))
    a.set_epoch(0)
    assert a.shard() == first[0], "an epoch's order depends only on seed and epoch"
    assert DistributedSampler(100, rank=0, size=2, seed=2).shard() != first[0]
    assert DistributedSampler(6, rank=0, size=1, shuffle=False).shard() == list(range(6))


def test_sampler_with_dataloader_and_resume_state():
    data = TensorDataset(torch.arange(20).float())
    sampler = DistributedSampler(data, rank=1, size=2, seed=5)
    loader = DataLoader(data, batch_size=3, sampler=sampler)
    batches = [b[0].long().tolist() for b in loader]
    assert [i for b in batches for i in b] == sampler.shard()
    assert len(loader) == 4
    state = dict(sampler.state_dict(), consumed=6)
    resumed = DistributedSampler(data, rank=1, size=2, seed=5)
    resumed.load_state_dict(state)
    assert list(resumed) == sampler.shard()[6:]
    with pytest.raises(ValueError, match="seed"):
        DistributedSampler(data, rank=1, size=2, seed=6).load_state_dict(state)


# ---------------------------------------------------------------- LR scaling and warm-up
def test_linear_scaling_and_warmup_values():
    assert linear_scaled_lr(0.1, 8192, 256) == pytest.approx(3.2)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    sched = WarmupSchedule.for_scaling(opt, global_batch=1024, reference_batch=256, warmup_steps=4)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # Goyal et al.: start at the reference rate 0.1, ramp linearly to 4 x 0.1 over 4 steps, then hold.
    assert lrs == pytest.approx([0.1, 0.175, 0.25, 0.325, 0.4, 0.4])
    opt2 = torch.optim.SGD([param], lr=1.0)
    cos = WarmupSchedule(opt2, 2, start_factor=0.0, total_steps=6, decay="cosine")
    got = []
    for _ in range(7):
        got.append(opt2.param_groups[0]["lr"])
        opt2.step()
        cos.step()
    expected = [0.0, 0.5] + [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert got == pytest.approx(expected)
    state = cos.state_dict()
    assert "optimizer" not in state and state["last_epoch"] == 7
    with pytest.raises(ValueError, match="total_steps"):
        WarmupSchedule(opt2, 5, decay="cosine", total_steps=3)


# ---------------------------------------------------------------- LARS and LAMB against their formulas
def _params():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4, 3))
    b = torch.nn.Parameter(torch.randn(3))
    grads = [(torch.randn(4, 3), torch.randn(3)) for _ in range(2)]
    return w, b, grads


def test_lars_two_steps_match_the_formula():
    w, b, grads = _params()
    lr, m, wd, eta, eps = 0.5, 0.9, 1e-2, 0.02, 1e-8
    opt = LARS([{"params": [w]}, {"params": [b], "adapt": False, "weight_decay": 0.0}], lr=lr, momentum=m,
               weight_decay=wd, trust_coefficient=eta, eps=eps)  # fmt: skip
    ref_w, ref_b = w.detach().clone(), b.detach().clone()
    vw, vb = torch.zeros_like(ref_w), torch.zeros_like(ref_b)
    for gw, gb in grads:
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
        local = eta * ref_w.norm() / (gw.norm() + wd * ref_w.norm() + eps)
        vw = m * vw + lr * local * (gw + wd * ref_w)
        ref_w = ref_w - vw
        vb = m * vb + lr * gb  # adapt=False, no decay: SGD with momentum
        ref_b = ref_b - vb
        torch.testing.assert_close(w.detach(), ref_w, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(b.detach(), ref_b, rtol=1e-6, atol=1e-7)


def test_lamb_two_steps_match_the_formula():
    w, b, grads = _params()
    lr, (b1, b2), eps, wd = 0.01, (0.9, 0.99), 1e-6, 0.1
    opt = LAMB([{"params": [w]}, {"params": [b], "adapt": False, "weight_decay": 0.0}], lr=lr, betas=(b1, b2),
               eps=eps, weight_decay=wd)  # fmt: skip
    ref = {"w": w.detach().clone(), "b": b.detach().clone()}
    mom = {k: torch.zeros_like(v) for k, v in ref.items()}
    sq = {k: torch.zeros_like(v) for k, v in ref.items()}
    for t, (gw, gb) in enumerate(grads, start=1):
        w.grad, b.grad = gw.clone(), gb.clone()
        opt.step()
        for key, g, decay, adapt in (("w", gw, wd, True), ("b", gb, 0.0, False)):
            mom[key] = b1 * mom[key] + (1 - b1) * g
            sq[key] = b2 * sq[key] + (1 - b2) * g * g
            u = (mom[key] / (1 - b1**t)) / ((sq[key] / (1 - b2**t)).sqrt() + eps) + decay * ref[key]
            ratio = ref[key].norm() / u.norm() if adapt else 1.0
            ref[key] = ref[key] - lr * ratio * u
        torch.testing.assert_close(w.detach(), ref["w"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(b.detach(), ref["b"], rtol=1e-6, atol=1e-7)


def test_trust_ratio_is_one_for_zero_weights():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    LAMB([p], lr=0.1, betas=(0.0, 0.0), eps=0.0).step()  # update = sign(g) = 1, ratio 1
    torch.testing.assert_close(p.detach(), torch.full((3,), -0.1))
    q = torch.nn.Parameter(torch.zeros(3))
    q.grad = torch.ones(3)
    LARS([q], lr=0.1, momentum=0.0).step()
    torch.testing.assert_close(q.detach(), torch.full((3,), -0.1))


# ---------------------------------------------------------------- clipping by global norm
@pytest.mark.parametrize("max_norm, norm_type", [(0.5, 2.0), (100.0, 2.0), (0.3, 1.0), (0.2, math.inf)])
def test_clip_grad_norm_equals_torch(max_norm, norm_type):
    torch.manual_seed(1)
    mine = [torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.randn(7))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    for a, b in zip(mine, ref):
        a.grad = torch.randn_like(a)
        b.grad = a.grad.clone()
    norm = clip_grad_norm_(mine, max_norm, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type=norm_type)
    torch.testing.assert_close(norm, expected)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a.grad, b.grad)


# ---------------------------------------------------------------- progress
def test_progress_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    bar = Progress(4, desc="epoch 1/1", stream=out, every=2)
    for _ in range(4):
        bar.update(8, 0.5)
    bar.close("eval accuracy 0.9")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in out.getvalue()
    assert lines[0].startswith("epoch 1/1  2/4  loss 0.5000") and "samples/s" in lines[0] and "ETA" in lines[0]
    assert lines[1].endswith("eval accuracy 0.9") and "4/4" in lines[1]
    silent = io.StringIO()
    quiet = Progress(4, enabled=False, stream=silent)
    quiet.update(8, 0.1)
    quiet.close()
    assert silent.getvalue() == ""


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_redraws_one_line_per_epoch():
    out = Terminal()
    bar = Progress(4, desc="epoch 2/3", stream=out)
    bar.steps = 1  # a resumed epoch: one step was done before the restart
    for _ in range(3):
        bar.update(8, 0.25)
    bar.close("eval accuracy 0.9")
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("eval accuracy 0.9\n") and text.startswith("\r"), repr(text)
    final = text.rsplit("\r", 1)[1]
    assert final.startswith("epoch 2/3  [" + "#" * 24 + "]  4/4  loss 0.2500") and "samples/s  in " in final
    silent = Terminal()
    quiet = Progress(4, enabled=False, stream=silent)  # every rank but 0
    quiet.update(8, 0.1)
    quiet.close()
    assert silent.getvalue() == ""
