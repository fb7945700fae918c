"""What users run, as one rank of test_launchers.py runs it under the launcher the test names.

`python launcher_job.py PART,PART,...` runs each part in turn and writes what each returned to
$JOB_SCRATCH/result-RANK.json:
- refusal: `init_process_group("hpdl")`, which must refuse a job no MPI launcher started (torchrun);
- smoke: `hpdl.init()` and every collective of the `Communicator`;
- horovod: Horovod's API (`hpdl.horovod`): allreduce, broadcast and a DistributedOptimizer step;
- ddp, accelerate, lightning: DDP, an Accelerate loop and a Lightning fit on the "hpdl" backend, each training
  the float64 MLP of torch_backend_training.py, whose parameters the test compares with one process's.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import hpdl
from hpdl.runtime.environment import detect
from torch_backend_training import BATCH, LR, STEPS, _train, data, lightning_module, make_model


def shard() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = data()
    rank, size = dist.get_rank(), dist.get_world_size()
    per = BATCH // size
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def params(model: nn.Module) -> list:
    return [p.detach().tolist() for p in model.parameters()]


def refusal() -> str:
    try:
        dist.init_process_group("hpdl")
    except Exception as error:  # the refusal's type is hpdl's LaunchError
        return f"{type(error).__name__}: {error}"
    return "not refused"


def smoke() -> dict:
    comm = hpdl.init()
    r, n = comm.rank, comm.size
    x = torch.full((5,), float(r + 1))
    comm.allreduce(x)
    gathered = comm.allgather(torch.tensor([float(r)]))
    root = torch.full((3,), float(r))
    comm.broadcast(root, root=0)
    blocks = comm.reduce_scatter(torch.arange(2 * n, dtype=torch.float32))
    swapped = comm.alltoall(torch.full((n,), float(r)))
    comm.barrier()
    return {
        "backend": comm.backend,
        "allreduce": x.tolist(),
        "allgather": gathered.tolist(),
        "broadcast": root.tolist(),
        "reduce_scatter": blocks.tolist(),
        "alltoall": swapped.tolist(),
        "local": [comm.local_rank, comm.local_size],
    }


def horovod() -> dict:
    import hpdl.horovod as hvd

    hvd.init()
    mean = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Average)
    model = make_model()
    if hvd.rank() != 0:  # different starting weights: the broadcast must replace them
        torch.nn.init.constant_(model[0].weight, 5.0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    x, y = data()
    per = BATCH // hvd.size()
    xs, ys = x[hvd.rank() * per : (hvd.rank() + 1) * per], y[hvd.rank() * per : (hvd.rank() + 1) * per]
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
    return {
        "mean": mean.item(),
        "size": hvd.size(),
        "local": [hvd.local_rank(), hvd.local_size()],
        "params": params(model),
    }


def hpdl_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("hpdl")


def ddp() -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    hpdl_group()
    model = make_model()
    wrapped = DDP(model, bucket_cap_mb=0.0005)  # several buckets
    x, y = shard()
    _train(wrapped, wrapped.parameters(), x, y)
    return {"backend": dist.get_backend(), "params": params(model)}


def accelerate() -> dict:
    """On the "hpdl" group, which Accelerate keeps; alone (no launcher), one process with no group."""
    from accelerate import Accelerator

    if detect().launcher != "none":
        hpdl_group()
    accelerator = Accelerator(cpu=True)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    wrapped, opt = accelerator.prepare(model, opt)
    x, y = shard() if dist.is_initialized() else data()
    for _ in range(STEPS):
        opt.zero_grad()
        accelerator.backward(nn.functional.mse_loss(wrapped(x), y))
        opt.step()
    backend = dist.get_backend() if dist.is_initialized() else None
    return {"backend": backend, "processes": accelerator.num_processes, "params": params(model)}


def lightning() -> dict:
    import pytorch_lightning as pl
    from lightning_fabric.plugins.environments import LightningEnvironment, MPIEnvironment
    from pytorch_lightning.strategies import DDPStrategy

    # under MPI launchers Lightning's MPI environment; alone, its own (which sets MASTER_ADDR and friends)
    environment = MPIEnvironment() if MPIEnvironment.detect() else LightningEnvironment()
    x, y = data()
    size = environment.world_size()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH // size)
    module = lightning_module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=size,
        strategy=DDPStrategy(process_group_backend="hpdl", cluster_environment=environment),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=os.environ["JOB_SCRATCH"],
    )
    trainer.fit(module, loader)
    return {"backend": dist.get_backend(), "params": params(module.net)}


PARTS = {
    "refusal": refusal,
    "smoke": smoke,
    "horovod": horovod,
    "ddp": ddp,
    "accelerate": accelerate,
    "lightning": lightning,
}

if __name__ == "__main__":
    results: dict[str, Any] = {"launcher": detect().launcher}
    for part in sys.argv[1].split(","):
        results[part] = PARTS[part]()
    rank = int(os.environ.get("RANK", os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))))
    with open(os.path.join(os.environ["JOB_SCRATCH"], f"result-{rank}.json"), "w") as out:  # lines of 24 KB
        json.dump(dict(results, rank=rank), out)  # written by two ranks at once would interleave
    hpdl.finalize()
    if dist.is_initialized():
        dist.destroy_process_group()
