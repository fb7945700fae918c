"""DataParallel: N ranks with per-rank batch b train like one process with batch N*b.

Tolerances: models in float64, where the only difference between N ranks
and one process is the order of the summations, agree to 1e-9 (the issue
asks for 1e-5); float32 runs to 1e-5; fp16 / bf16 wire compression rounds
every averaged gradient to 11 / 8 significant bits, so those runs agree to
2e-3 / 2e-2 after 10 steps (relative to parameters of size ~0.1 - 1).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hpdl.comm.trace import Tracer
from hpdl.parallel import DataParallel

DIN, DOUT, B = 6, 3, 4
STEPS = 10


def make_model(seed: int, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIN, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, DOUT)).to(dtype)


def make_data(nprocs: int, steps: int, micro: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x[step, micro, rank]: a (B, DIN) batch; the same tensors on every rank and in the reference."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(steps, micro, nprocs, B, DIN, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(steps, micro, nprocs, B, DOUT, generator=g, dtype=torch.float64).to(dtype)
    return x, y


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return torch.optim.Adam(params, lr=0.01)


def train_dp(comm, cfg: dict) -> list[torch.Tensor]:
    """Train with DataParallel on this rank's shard; every rank starts from a different init (rank 0's wins)."""
    dtype = getattr(torch, cfg.get("dtype", "float64"))
    micro = cfg.get("micro", 1)
    model = DataParallel(
        make_model(100 + comm.rank, dtype),
        comm,
        bucket_mb=cfg.get("bucket_mb", 0.001),  # ~1 KB: several buckets even for this small model
        compression=cfg.get("compression"),
    )
    opt = make_optimizer(cfg["opt"], model.parameters())
    x, y = make_data(comm.size, STEPS, micro, dtype)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=cfg.get("set_to_none", True))
        for j in range(micro):
            loss = nn.functional.mse_loss(model(x[step, j, comm.rank]), y[step, j, comm.rank]) / micro
            if j < micro - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.module.parameters()]


def train_reference(cfg: dict, nprocs: int) -> list[torch.Tensor]:
    """One process, batch nprocs * B * micro per step, rank 0's initial model."""
    dtype = getattr(torch, cfg.get("dtype", "float64"))
    micro = cfg.get("micro", 1)
    model = make_model(100, dtype)
    opt = make_optimizer(cfg["opt"], model.parameters())
    x, y = make_data(nprocs, STEPS, micro, dtype)
    for step in range(STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[step].reshape(-1, DIN)), y[step].reshape(-1, DOUT))
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def train_many(comm, cfgs: list[dict]) -> list[list[torch.Tensor]]:
    return [train_dp(comm, cfg) for cfg in cfgs]


CONFIGS = [
    ({"opt": "sgd"}, 1e-9),
    ({"opt": "adam"}, 1e-9),
    ({"opt": "sgd", "micro": 3}, 1e-9),
    ({"opt": "adam", "micro": 2, "set_to_none": False}, 1e-9),
    ({"opt": "adam", "bucket_mb": 25}, 1e-9),
    ({"opt": "sgd", "dtype": "float32"}, 1e-5),
    ({"opt": "sgd", "dtype": "float32", "compression": "fp16"}, 2e-3),
    ({"opt": "sgd", "dtype": "float32", "compression": "bf16"}, 2e-2),
]


def check_equivalence(results: list, cfgs: list, tols: list, nprocs: int) -> None:
    for index, (cfg, tol) in enumerate(zip(cfgs, tols)):
        reference = train_reference(cfg, nprocs)
        for rank, per_rank in enumerate(results):
            for i, (got, want) in enumerate(zip(per_rank[index], reference)):
                err = float((got.double() - want.double()).abs().max())
                assert err <= tol, f"{cfg} rank {rank} parameter {i}: max |diff| {err:.3g} > {tol}"
        # the ranks agree with each other bit for bit (they apply the same averaged gradient)
        for per_rank in results[1:]:
            assert all(torch.equal(a, b) for a, b in zip(per_rank[index], results[0][index])), cfg


@pytest.mark.parametrize(
    ("backend", "nprocs", "configs"),
    [("self", 1, CONFIGS), ("mpi", 2, CONFIGS), ("mpi", 4, CONFIGS[:4]), ("torch", 2, CONFIGS[:3] + CONFIGS[5:7])],
    ids=["self-1", "mpi-2", "mpi-4", "torch-2"],
)
def test_equivalence_with_one_process_on_the_whole_batch(ranks, backend, nprocs, configs):
    cfgs = [c for c, _ in configs]
    results = ranks(backend, nprocs).run(train_many, cfgs, timeout=120)
    check_equivalence(results, cfgs, [t for _, t in configs], nprocs)


def test_compression_is_not_exact(ranks):
    """The compressed runs really went through a 16-bit wire: they differ from the exact ones."""
    exact, fp16 = ranks("mpi", 2).run(train_many, [{"opt": "sgd", "dtype": "float32"}, CONFIGS[6][0]])[0]
    assert max(float((a - b).abs().max()) for a, b in zip(exact, fp16)) > 1e-7


# ---------------------------------------------------------------- parameters without gradients
class Branchy(nn.Module):
    """`shared` always used; `odd` only on odd ranks; `never` on no rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.never = nn.Linear(DIN, DOUT).double()
        self.odd = nn.Linear(DIN, DOUT).double()
        self.shared = nn.Linear(DIN, DOUT).double()  # registered last: its bucket launches first

    def forward(self, x: torch.Tensor, use_odd: bool) -> torch.Tensor:
        out = self.shared(x)
        return out + self.odd(x) if use_odd else out


def branchy_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + rank)
    x = torch.randn(B, DIN, generator=g, dtype=torch.float64)
    return model(x, rank % 2 == 1).pow(2).mean()


def unused_body(comm):
    model = DataParallel(Branchy(), comm, bucket_mb=0.0001)  # one bucket per parameter
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    before = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    grads = []
    for step in range(3):
        opt.zero_grad()
        branchy_loss(model, comm.rank, step).backward()
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.module.named_parameters()})
        opt.step()
    moved = {n: not torch.equal(before[n], p) for n, p in model.module.named_parameters()}
    return grads, moved


def branchy_reference(nprocs: int, step: int, model: nn.Module) -> dict:
    model.zero_grad(set_to_none=True)
    (sum(branchy_loss(model, r, step) for r in range(nprocs)) / nprocs).backward()
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("backend", "nprocs"), [("mpi", 2), ("mpi", 4), ("torch", 2)])
def test_parameters_without_gradients_do_not_hang(ranks, backend, nprocs):
    results = ranks(backend, nprocs).run(unused_body, timeout=60)
    reference = Branchy()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    for step in range(3):
        want = branchy_reference(nprocs, step, reference)
        opt.step()
        for rank, (grads, _moved) in enumerate(results):
            for name, value in want.items():
                got = grads[step][name]
                if value is None:
                    assert got is None, f"rank {rank} step {step}: {name} has a gradient; no rank used it"
                else:
                    assert got is not None, f"rank {rank} step {step}: {name} lost its gradient"
                    assert torch.allclose(got, value, atol=1e-12), (rank, step, name)
    for _, moved in results:
        assert moved == {
            "never.weight": False,
            "never.bias": False,
            "odd.weight": True,
            "odd.bias": True,
            "shared.weight": True,
            "shared.bias": True,
        }


# ---------------------------------------------------------------- buffers
def buffers_body(comm, broadcast_buffers: bool):
    torch.manual_seed(comm.rank)  # different initial weights and buffers on every rank
    net = nn.Sequential(nn.Linear(DIN, 8), nn.BatchNorm1d(8))
    net[1].running_mean.fill_(float(comm.rank))
    model = DataParallel(net, comm, broadcast_buffers=broadcast_buffers)
    after_wrap = net[1].running_mean.clone()
    seen = []
    net.register_forward_pre_hook(lambda module, args: seen.append(net[1].running_mean.clone()))
    for _ in range(3):
        x = torch.randn(B, DIN) + comm.rank  # different data on every rank: different local statistics
        model(x).sum().backward()
    weight = net[0].weight.detach().clone()
    return after_wrap, seen, weight


@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_buffers_are_broadcast_from_rank_0(ranks, backend):
    results = ranks(backend, 2).run(buffers_body, True)
    (wrap0, seen0, w0), (wrap1, seen1, w1) = results
    assert torch.equal(wrap0, torch.zeros(8)) and torch.equal(wrap1, wrap0)
    assert torch.equal(w0, w1)  # parameters broadcast at wrap time
    for a, b in zip(seen0, seen1):  # every forward starts from rank 0's statistics
        assert torch.equal(a, b)
    assert not torch.equal(seen0[1], seen0[0])  # and they do change between steps

    off = ranks(backend, 2).run(buffers_body, False)
    assert torch.equal(off[0][0], off[1][0])  # still broadcast once when wrapping
    assert not torch.equal(off[0][1][2], off[1][1][2])  # then each rank keeps its own


# ---------------------------------------------------------------- tracing, shapes of the API
def traced_body(comm):
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    comm.tracer = Tracer()
    try:
        model = DataParallel(net, comm, bucket_mb=0.25)  # one layer per bucket
        for _ in range(2):
            model(torch.randn(32, 256)).sum().backward()
        return comm.tracer.events, len(model.reducer.buckets)
    finally:
        comm.tracer = None


def test_trace_shows_buckets_launched_during_backward(ranks):
    for events, nbuckets in ranks("mpi", 2).run(traced_body):
        names = [e["name"] for e in events]
        assert names.count("forward") == 2 and names.count("backward") == 2
        buckets = [e for e in events if e["name"].startswith("allreduce bucket")]
        assert len(buckets) == 2 * nbuckets and nbuckets >= 6
        backward = [e for e in events if e["name"] == "backward"][-1]
        last = buckets[-nbuckets:]
        end = backward["ts"] + backward["dur"]
        # the first bucket starts well before backward ends: communication overlaps the rest of backward
        assert last[0]["ts"] < end - 0.2 * backward["dur"]
        # float32 gradients plus one usage flag per parameter
        assert sum(b["args"]["bytes"] for b in last) == (6 * (256 * 256 + 256) + 12) * 4


def test_self_backend_is_the_plain_model():
    from hpdl.comm.self_backend import SelfCommunicator

    comm = SelfCommunicator(timeout=10.0, debug=False)
    plain = make_model(3)
    wrapped = DataParallel(make_model(3), comm, bucket_mb=0.001)
    x, y = make_data(1, 1, 1, torch.float64)
    for m in (plain, wrapped):
        nn.functional.mse_loss(m(x[0, 0, 0]), y[0, 0, 0]).backward()
    for a, b in zip(plain.parameters(), wrapped.module.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert len(wrapped.buckets) > 1 and sum(b["numel"] for b in wrapped.buckets) == sum(
        p.numel() for p in plain.parameters()
    )


def test_bad_arguments_are_clear_errors():
    from hpdl.comm.self_backend import SelfCommunicator

    comm = SelfCommunicator(timeout=10.0, debug=False)
    with pytest.raises(ValueError, match="compression"):
        DataParallel(nn.Linear(2, 2), comm, compression="int8")
    with pytest.raises(ValueError, match="bucket_mb"):
        DataParallel(nn.Linear(2, 2), comm, bucket_mb=0)
    with pytest.raises(TypeError, match="nn.Module"):
        DataParallel(lambda x: x, comm)  # type: ignore[arg-type]


def sync_gradients_body(comm):
    model = DataParallel(make_model(0), comm)
    with model.no_sync():
        model(torch.full((B, DIN), float(comm.rank), dtype=torch.float64)).sum().backward()
    local = [p.grad.clone() for p in model.module.parameters()]
    model.sync_gradients()
    return local, [p.grad.clone() for p in model.module.parameters()]


def test_no_sync_then_explicit_sync(ranks):
    (local0, avg0), (local1, avg1) = ranks("mpi", 2).run(sync_gradients_body)
    assert not all(torch.equal(a, b) for a, b in zip(local0, local1))
    for a, b, g0, g1 in zip(local0, local1, avg0, avg1):
        assert torch.allclose(g0, (a + b) / 2) and torch.equal(g0, g1)
