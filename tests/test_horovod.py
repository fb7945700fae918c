"""`import hpdl.horovod as hvd`: a training script written as for Horovod gives one process's result.

The body below is how a Horovod user writes the loop (hvd.init, a
DistributedOptimizer with named_parameters, broadcast of parameters and
optimizer state); only the import names hpdl. Models are float64, so the
tolerance against one process on the whole batch is 1e-9.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

DIN, DOUT, B, STEPS = 5, 2, 4, 10


def data(nprocs: int, passes: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    x = torch.randn(STEPS, passes, nprocs, B, DIN, generator=g, dtype=torch.float64)
    return x, torch.randn(STEPS, passes, nprocs, B, DOUT, generator=g, dtype=torch.float64)


def new_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIN, 12), nn.ReLU(), nn.Linear(12, DOUT)).double()


def horovod_script(comm, opt_name: str, passes: int, compression: str):
    import hpdl.horovod as hvd

    hvd.init()
    model = new_model(seed=hvd.rank())  # deliberately different on every rank: broadcast must fix it
    if opt_name == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=getattr(hvd.Compression, compression),
        backward_passes_per_step=passes,
        op=hvd.Average,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    x, y = data(hvd.size(), passes)
    for step in range(STEPS):
        optimizer.zero_grad()
        for j in range(passes):
            loss = nn.functional.mse_loss(model(x[step, j, hvd.rank()]), y[step, j, hvd.rank()]) / passes
            loss.backward()
        optimizer.step()
        scheduler.step()
    avg_loss = hvd.allreduce(loss.detach(), name="avg_loss")
    return [p.detach().clone() for p in model.parameters()], float(avg_loss), hvd.size(), hvd.local_rank()


def reference(opt_name: str, passes: int, nprocs: int) -> list[torch.Tensor]:
    model = new_model(seed=0)
    if opt_name == "adam":
        optimizer: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    x, y = data(nprocs, passes)
    for step in range(STEPS):
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[step].reshape(-1, DIN)), y[step].reshape(-1, DOUT)).backward()
        optimizer.step()
        scheduler.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    ("backend", "opt_name", "passes", "compression", "tol"),
    [
        ("mpi", "sgd", 1, "none", 1e-9),
        ("mpi", "adam", 1, "none", 1e-9),
        ("mpi", "sgd", 2, "none", 1e-9),
        ("mpi", "adam", 1, "fp16", 5e-3),
        ("torch", "adam", 2, "none", 1e-9),
    ],
)
def test_horovod_script_matches_one_process(ranks, backend, opt_name, passes, compression, tol):
    results = ranks(backend, 2).run(horovod_script, opt_name, passes, compression)
    want = reference(opt_name, passes, 2)
    for params, _avg_loss, size, local_rank in results:
        assert size == 2 and local_rank in (0, 1)
        for got, expected in zip(params, want):
            assert float((got - expected).abs().max()) <= tol
    assert results[0][1] == results[1][1]  # hvd.allreduce averaged the last loss


def collectives_script(comm):
    import hpdl.horovod as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    x = torch.full((3,), float(r + 1))
    out = {
        "avg": hvd.allreduce(x),
        "sum": hvd.allreduce(x, op=hvd.Sum),
        "average_false": hvd.allreduce(x, average=False),
        "max": hvd.allreduce(x, op=hvd.Max),
        "fp16": hvd.allreduce(x, compression=hvd.Compression.fp16),
        "scaled": hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5),
        "unchanged": x.clone(),
        "gather": hvd.allgather(torch.full((r + 1, 2), float(r))),
        "bcast": hvd.broadcast(torch.tensor([float(r)]), root_rank=n - 1),
    }
    handle = hvd.allreduce_async(x, op=hvd.Sum)
    out["async"] = hvd.synchronize(handle)
    y = x.clone()
    hvd.allreduce_(y, op=hvd.Sum)
    out["inplace"] = y
    z = torch.tensor([float(r)])
    hvd.broadcast_(z, 0)
    out["bcast_inplace"] = z
    out["objects"] = hvd.allgather_object({"rank": r})
    out["adasum"] = hvd.allreduce(x, op=hvd.Adasum)  # parallel gradients: Adasum averages them
    return out


def test_horovod_collectives(ranks):
    for rank, out in enumerate(ranks("mpi", 2).run(collectives_script)):
        assert torch.equal(out["avg"], torch.full((3,), 1.5))
        assert torch.equal(out["sum"], torch.full((3,), 3.0))
        assert torch.equal(out["average_false"], torch.full((3,), 3.0))
        assert torch.equal(out["max"], torch.full((3,), 2.0))
        assert torch.equal(out["fp16"], torch.full((3,), 1.5)) and out["fp16"].dtype == torch.float32
        assert torch.equal(out["scaled"], torch.full((3,), 3.0))
        assert torch.equal(out["unchanged"], torch.full((3,), float(rank + 1)))  # out of place
        assert torch.equal(out["gather"], torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))
        assert torch.equal(out["bcast"], torch.tensor([1.0]))
        assert torch.equal(out["async"], torch.full((3,), 3.0))
        assert torch.equal(out["inplace"], torch.full((3,), 3.0))
        assert torch.equal(out["bcast_inplace"], torch.tensor([0.0]))
        assert out["objects"] == [{"rank": 0}, {"rank": 1}]
        assert torch.allclose(out["adasum"], torch.full((3,), 1.5))  # (1 - 6/6) x1 + (1 - 6/24) x2


@pytest.fixture
def self_world():
    import hpdl

    yield hpdl.init("self")
    hpdl.finalize()


def test_horovod_argument_errors(self_world):
    import hpdl.horovod as hvd

    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(opt, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(opt, named_parameters=[("w", p) for p in nn.Linear(2, 2).parameters()])
    with pytest.raises(ValueError, match="were not named"):
        hvd.DistributedOptimizer(opt, named_parameters=nn.Linear(2, 2).named_parameters())
    with pytest.raises(TypeError, match="Compressor"):
        hvd.DistributedOptimizer(opt, compression=object())
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(opt, backward_passes_per_step=0)


def test_synchronize_then_clip_then_step_without_synchronize(self_world):
    """Horovod's pattern for gradient clipping works on one process (the self backend)."""
    import hpdl.horovod as hvd

    model = new_model(1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=2)
    model(torch.ones(1, DIN, dtype=torch.float64)).sum().backward()  # 1 of 2 passes: not reduced yet
    optimizer.synchronize()  # reduces now
    nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with optimizer.skip_synchronize():
        optimizer.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert optimizer.state_dict()["param_groups"][0]["lr"] == 0.1
