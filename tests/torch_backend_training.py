"""Rank bodies for test_torch_backend_training.py: unmodified torch training code on the hpdl and the gloo group.

Every body trains the same float64 MLP for a few SGD steps on the same
data and returns the final parameters; the test compares them with one
process training on the whole batch (`reference`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from torch_backend_bodies import groups

BATCH, IN, HIDDEN, OUT = 12, 6, 16, 3
STEPS = 3
LR = 0.1


def make_model() -> nn.Sequential:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 8), nn.Tanh(), nn.Linear(8, OUT)).double()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(BATCH, IN, generator=gen, dtype=torch.float64), torch.randn(
        BATCH, OUT, generator=gen, dtype=torch.float64
    )


def _train(model: nn.Module, params: Any, x: torch.Tensor, y: torch.Tensor, steps: int = STEPS) -> None:
    opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def reference(steps: int = STEPS) -> list:
    """One process, the whole batch."""
    model = make_model()
    x, y = data()
    _train(model, model.parameters(), x, y, steps)
    return [p.detach().tolist() for p in model.parameters()]


def assert_same_params(got: list, want: list, what: str) -> None:
    """float64 parameters (nested lists) equal to one process's after a few steps: sums in another order, 1e-12."""
    flat_got, flat_want = _flat(got), _flat(want)
    assert len(flat_got) == len(flat_want), what
    worst = max(abs(a - b) for a, b in zip(flat_got, flat_want))
    assert worst < 1e-12, f"{what}: differs from one process by {worst}"


def _flat(value: object) -> list[float]:
    if isinstance(value, list):
        return [v for item in value for v in _flat(item)]
    return [float(value)]  # type: ignore[arg-type]


def _shard(g: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data()
    rank, size = dist.get_rank(g), dist.get_world_size(g)
    per = BATCH // size
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def ddp(comm: Any, name: str, hook: Optional[str] = None, compiled: bool = False) -> list:
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = groups()[name]
    model = make_model()
    # several buckets (overlap with backward); dynamo's DDPOptimizer wants the first bucket no larger than the rest
    wrapped = DDP(model, process_group=g, bucket_cap_mb=None if compiled else 0.0005)
    if hook == "allreduce":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        wrapped.register_comm_hook(g, default_hooks.allreduce_hook)
    elif hook == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        # rank 8 >= every weight's smaller dimension: the low-rank step is exact, so it must equal one process
        state = powersgd.PowerSGDState(process_group=g, matrix_approximation_rank=8, start_powerSGD_iter=2)
        wrapped.register_comm_hook(state, powersgd.powerSGD_hook)
    runner: Any = torch.compile(wrapped, backend="eager") if compiled else wrapped
    x, y = _shard(g)
    _train(runner, wrapped.parameters(), x, y)
    return [p.detach().tolist() for p in model.parameters()]


def _mesh(g: Any) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(g, "cpu")


def fsdp2(comm: Any, name: str, mixed: bool = False, pooled: bool = False) -> Any:
    """`pooled`: FSDP2 takes its communication buffers from the group (hpdl's buffer pool, every size pooled
    here); it then returns the parameters with how many buffers the pool made and reused."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from hpdl.interop.torch_backend.buffer_pool import pool

    g = groups()[name]
    mesh = _mesh(g)
    model = make_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64) if mixed else None
    kwargs = {"mesh": mesh, "mp_policy": policy} if policy else {"mesh": mesh}
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    made, reused, min_bytes = pool.made, pool.reused, pool.min_bytes
    if pooled:
        pool.min_bytes = 0
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_allocate_memory_from_process_group_for_comm(True)
    x, y = _shard(g)
    if mixed:
        x = x.float()
        y = y.float()
    try:
        _train(model, model.parameters(), x, y)
    finally:
        pool.min_bytes = min_bytes  # (the rank serves other tests next)
    params = [p.full_tensor().detach().tolist() for p in model.parameters()]
    return (params, pool.made - made, pool.reused - reused) if pooled else params


def tensor_parallel(comm: Any, name: str) -> list:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    g = groups()[name]
    model = make_model()
    parallelize_module(model, _mesh(g), {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x, y = data()  # tensor parallel: every rank sees the whole batch
    _train(model, model.parameters(), x, y)
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().tolist() for p in model.parameters()]


def pipeline(comm: Any, name: str) -> list:
    """Two stages (ranks 0 and 1), two micro-batches, GPipe; every rank returns its stage's parameters."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    g = groups()[name]
    rank = dist.get_rank(g)
    layers = list(make_model())
    part = nn.Sequential(*(layers[:2] if rank == 0 else layers[2:]))
    stage = PipelineStage(part, rank, 2, torch.device("cpu"), group=g)
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(part.parameters(), lr=LR, momentum=0.9)
    x, y = data()
    for _ in range(STEPS):
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        opt.step()
    return [p.detach().tolist() for p in part.parameters()]


def checkpoint_reshard(comm: Any, name: str, path: str) -> tuple:
    """DCP: save an FSDP2-sharded model, load it into an unsharded copy on every rank (another layout)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    g = groups()[name]
    model = make_model()
    fully_shard(model, mesh=_mesh(g))
    x, y = _shard(g)
    _train(model, model.parameters(), x, y, steps=1)
    saved = [p.full_tensor().detach().clone() for p in model.parameters()]
    dcp.save({"model": model.state_dict()}, checkpoint_id=path, process_group=g)
    fresh = nn.Sequential(*make_model())
    for p in fresh.parameters():
        p.data.zero_()
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=path, process_group=g)
    fresh.load_state_dict(state["model"])
    return [p.tolist() for p in saved], [p.detach().tolist() for p in fresh.parameters()]


def accelerate_loop(comm: Any) -> tuple:
    """Hugging Face Accelerate on a group that already exists (it keeps it: its CPU choice would be gloo)."""
    from accelerate import Accelerator

    groups()
    accelerator = Accelerator(cpu=True)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    wrapped, opt = accelerator.prepare(model, opt)
    x, y = _shard(dist.group.WORLD)
    for _ in range(STEPS):
        opt.zero_grad()
        accelerator.backward(nn.functional.mse_loss(wrapped(x), y))
        opt.step()
    return dist.get_backend(), [p.detach().tolist() for p in accelerator.unwrap_model(wrapped).parameters()]


def lightning_module() -> Any:
    """The float64 MLP as a LightningModule: mse loss, SGD with momentum (the same steps as `_train`)."""
    import pytorch_lightning as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    return Module()


def lightning_fit(comm: Any) -> tuple:
    """PyTorch Lightning: DDPStrategy(process_group_backend="hpdl") with its MPI cluster environment."""
    import pytorch_lightning as pl
    from lightning_fabric.plugins.environments import MPIEnvironment
    from pytorch_lightning.strategies import DDPStrategy

    groups()
    from mpi4py import MPI

    size = MPI.COMM_WORLD.Get_size()  # the group may not exist yet: then Lightning creates it
    x, y = data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH // size)
    module = lightning_module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=size,
        strategy=DDPStrategy(process_group_backend="hpdl", cluster_environment=MPIEnvironment()),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir="/tmp",
    )
    trainer.fit(module, loader)
    return dist.get_backend(), [p.detach().tolist() for p in module.net.parameters()]


def hsdp(comm: Any) -> tuple:
    """HSDP: FSDP2 on a 2-D mesh (2 replicas x 2 shards) whose sub-groups DeviceMesh makes on the hpdl group.

    Runs in the plain 4-rank pool (a pool of its own would start four more ranks for one test): the default
    group it makes is destroyed before it returns, so the pool's later bodies see none.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    assert not dist.is_initialized(), "the plain pool's ranks hold no torch.distributed group"
    dist.init_process_group("hpdl")
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = make_model()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x, y = _shard(dist.group.WORLD)  # the batch is split over all four ranks
        _train(model, model.parameters(), x, y)
        sub_groups = [(dist.get_backend(mesh.get_group(d)), mesh.size(i)) for i, d in enumerate(mesh.mesh_dim_names)]
        return sub_groups, [p.full_tensor().detach().tolist() for p in model.parameters()]
    finally:
        dist.destroy_process_group()
