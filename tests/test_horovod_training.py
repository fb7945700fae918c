"""hpdl.horovod's DistributedOptimizer (sparse, Adasum, own Compressor, warnings), SyncBatchNorm, elastic and
timeline: N ranks against one process on the whole batch, float64."""

from __future__ import annotations

import json
import os
import tempfile
import warnings

import pytest
import torch
from torch import nn


def embedding_body(comm, sparse_as_dense):
    import hpdl.horovod as hvd

    hvd.init()
    r = hvd.rank()
    torch.manual_seed(0)
    model = nn.Embedding(10, 3, sparse=True).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), sparse_as_dense=sparse_as_dense)
    idx = torch.tensor([[1, 2, 4], [4, 3, 9]]) if r == 0 else torch.tensor([[1, 3, 7], [4, 7, 9]])
    for _ in range(2):
        opt.zero_grad()
        (model(idx) ** 2).sum().backward()
        opt.step()
    return model.weight.detach().clone(), model.weight.grad.is_sparse


def embedding_reference():
    torch.manual_seed(0)
    model = nn.Embedding(10, 3, sparse=True).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    both = [torch.tensor([[1, 2, 4], [4, 3, 9]]), torch.tensor([[1, 3, 7], [4, 7, 9]])]
    for _ in range(2):
        opt.zero_grad()
        sum((model(i) ** 2).sum() for i in both).div(2).backward()
        opt.step()
    return model.weight.detach()


@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_sparse_gradients(ranks, sparse_as_dense):
    want = embedding_reference()
    for weight, is_sparse in ranks("mpi", 2).run(embedding_body, sparse_as_dense):
        assert is_sparse
        assert torch.allclose(weight, want, atol=1e-12)


class Halve:
    """A user's own Compressor (Horovod's interface): sends halves, doubles back."""

    @staticmethod
    def compress(tensor):
        return tensor / 2, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor * 2


def optimizer_features_body(comm):
    import hpdl.horovod as hvd

    hvd.init()
    r = hvd.rank()
    out = {}
    x = torch.full((4, 3), float(r + 1), dtype=torch.float64)
    for name, kwargs in {
        "own_compressor": {"compression": Halve},
        "predivide": {"gradient_predivide_factor": 2.0},
        "sum": {"op": hvd.Sum},
        "groups": {"groups": 2},
    }.items():
        torch.manual_seed(0)
        model = nn.Linear(3, 2).double()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
        model(x).sum().backward()
        opt.step()
        out[name] = model.weight.detach().clone()
        out[name + "_isinstance"] = isinstance(opt, torch.optim.SGD)
    # the warning of step() after synchronize() without skip_synchronize()
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(x).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out["warning"] = [str(w.message) for w in caught]
    # a second backward before step: Horovod's AssertionError
    model(x).sum().backward()
    try:
        model(x).sum().backward()
        out["twice"] = None
    except AssertionError as exc:
        out["twice"] = str(exc)
    opt.zero_grad()
    # Adasum: the delta optimizer (local step, Adasum of the parameter deltas)
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    start = model.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
    model(x).sum().backward()
    opt.step()
    out["adasum_delta"] = (model.weight.detach() - start).clone()
    return out


def test_optimizer_features(ranks):
    from hpdl.horovod.adasum import reduce_all

    results = ranks("mpi", 2).run(optimizer_features_body)
    torch.manual_seed(0)
    w0 = nn.Linear(3, 2).double().weight.detach()
    # d(sum(W x + b))/dW = column sums of x: 4 (r + 1) per entry; mean over ranks 6, sum 12
    for out in results:
        for name in ("own_compressor", "predivide", "groups"):
            assert torch.allclose(out[name], w0 - 0.1 * 6.0, atol=1e-12), name
            assert out[name + "_isinstance"]
        assert torch.allclose(out["sum"], w0 - 0.1 * 12.0, atol=1e-12)
        assert len(out["warning"]) == 1 and "skip_synchronize()" in out["warning"][0]
        assert out["twice"] is not None and "backward_passes_per_step" in out["twice"]
        deltas = [torch.full((2, 3), -0.1 * 4.0 * (k + 1), dtype=torch.float64) for k in range(2)]
        assert torch.allclose(out["adasum_delta"], reduce_all(deltas), atol=1e-12)


def sync_bn_body(comm):
    import hpdl.horovod as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    g = torch.Generator().manual_seed(5)
    full = torch.randn(n * 3, 4, 2, 2, generator=g, dtype=torch.float64)
    x = full[r * 3 : (r + 1) * 3].clone().requires_grad_()
    bn = hvd.SyncBatchNorm(4).double()
    with torch.no_grad():
        bn.weight.copy_(torch.arange(1.0, 5.0))
    y = bn(x)
    (y * torch.arange(y.numel(), dtype=torch.float64).view_as(y).add(r * 1000)).sum().backward()
    wgrad = hvd.allreduce(bn.weight.grad, op=hvd.Sum)
    return y.detach(), x.grad, wgrad, bn.running_mean.clone(), bn.running_var.clone()


@pytest.mark.parametrize("nprocs", [2, 3])
def test_sync_batch_norm_is_batch_norm_of_the_whole_batch(ranks, nprocs):
    results = ranks("mpi", nprocs).run(sync_bn_body)
    g = torch.Generator().manual_seed(5)
    full = torch.randn(nprocs * 3, 4, 2, 2, generator=g, dtype=torch.float64).requires_grad_()
    bn = nn.BatchNorm2d(4).double()
    with torch.no_grad():
        bn.weight.copy_(torch.arange(1.0, 5.0))
    y = bn(full)
    weights = torch.cat([torch.arange(3 * 16, dtype=torch.float64).view(3, 4, 2, 2) + r * 1000 for r in range(nprocs)])
    (y * weights).sum().backward()
    for r, (out, xgrad, wgrad, rmean, rvar) in enumerate(results):
        assert torch.allclose(out, y[r * 3 : (r + 1) * 3].detach(), atol=1e-10)
        assert torch.allclose(xgrad, full.grad[r * 3 : (r + 1) * 3], atol=1e-9)
        assert torch.allclose(wgrad, bn.weight.grad, atol=1e-9)
        assert torch.allclose(rmean, bn.running_mean, atol=1e-12)
        assert torch.allclose(rvar, bn.running_var, atol=1e-12)


def elastic_body(comm):
    import hpdl.horovod as hvd

    hvd.init()
    r = hvd.rank()
    torch.manual_seed(r)  # different on every rank: sync() takes rank 0's
    model = nn.Linear(2, 2).double()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, batch=0)
    attempts = []

    @hvd.elastic.run
    def train(state):
        attempts.append(state.batch)
        for b in range(state.batch, 4):
            if b == 2 and len(attempts) == 1:  # a collective fails once (a mismatch the agreement catches)
                hvd.allreduce(torch.ones(1 + r), name="fails-once")
            model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
            opt.step()
            opt.zero_grad()
            state.sampler.record_batch(b, 1)
            state.batch = b + 1
            if b == 1:
                state.commit()
        return state.batch

    final = train(state)
    return final, attempts, model.weight.detach().clone(), list(iter(sampler)), sampler.state_dict()


def test_elastic_run_restores_the_last_commit_and_retries(ranks):
    results = ranks("mpi", 2).run(elastic_body)
    (f0, a0, w0, idx0, sd0), (f1, a1, w1, idx1, sd1) = results
    assert f0 == f1 == 4
    assert a0 == a1 == [0, 2]  # the retry starts at the committed batch
    assert torch.equal(w0, w1)  # synced from rank 0, then trained in step
    assert sd0 == sd1 and sd0["processed_num"] == 8
    assert sorted(idx0 + idx1) == [4, 5, 6, 7, 8, 9]  # restored to the commit: resumes after its batches


def timeline_body(comm, path):
    import hpdl.horovod as hvd

    hvd.init()
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="test_allreduce")
    hvd.stop_timeline()
    return hvd.rank()


def test_timeline_file(ranks):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "timeline.json")
        ranks("mpi", 2).run(timeline_body, path)
        with open(path) as f:
            events = json.load(f)
    text = json.dumps(events)
    for needle in ("allreduce.test_allreduce", "NEGOTIATE_ALLREDUCE", '"ALLREDUCE"', "CYCLE_START"):
        assert needle in text
