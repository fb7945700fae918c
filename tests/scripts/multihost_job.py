"""One rank of test_multihost.py's job on two simulated hosts (2 ranks each): what crosses a host boundary.

`python multihost_job.py OUT_DIR` writes OUT_DIR/rank-N.json with what this rank saw: its host and place on it,
the collectives' results (checked against their closed forms here), the paths the allreduce took, and the
parameters after DDP steps on the "hpdl" torch backend, Horovod's DistributedOptimizer, a pipeline with one stage
per host, ZeRO-3, FSDP2 and a Lightning fit, K-Means's centres on rows held on both hosts, and every collective of
torch.distributed on the "hpdl" group against gloo's.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import torch
import torch.distributed as dist
from launcher_job import ddp, horovod, lightning
from torch import nn

import hpdl
from torch_backend_training import BATCH, LR, STEPS, data, fsdp2, make_model


def expect(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got, want):
        raise AssertionError(f"{what}: got {got.tolist()[:8]}, want {want.tolist()[:8]}")


def collectives(comm: hpdl.Communicator) -> list[str]:
    """Every collective over both hosts, in two dtypes and three sizes (one past the shared-memory threshold)."""
    r, n = comm.rank, comm.size
    done = []
    for dtype in (torch.float32, torch.int64):
        for count in (1, 4099, 1 << 20):
            x = torch.full((count,), r + 1, dtype=dtype)
            comm.allreduce(x)
            expect(f"allreduce {dtype} {count}", x, torch.full((count,), n * (n + 1) // 2, dtype=dtype))
            got = comm.allgather(torch.full((count,), r, dtype=dtype))
            expect(f"allgather {dtype} {count}", got, torch.arange(n, dtype=dtype).repeat_interleave(count))
            y = torch.full((count,), r, dtype=dtype)
            comm.broadcast(y, root=n - 1)
            expect(f"broadcast {dtype} {count}", y, torch.full((count,), n - 1, dtype=dtype))
            block = comm.reduce_scatter(torch.ones(count * n, dtype=dtype))
            expect(f"reduce_scatter {dtype} {count}", block, torch.full((count,), n, dtype=dtype))
            swapped = comm.alltoall(torch.full((n,), r, dtype=dtype))
            expect(f"alltoall {dtype}", swapped, torch.arange(n, dtype=dtype))
            done.append(f"{dtype} {count}")
    comm.barrier()
    return done


def torch_collectives() -> list[str]:
    """Every collective of torch.distributed on the "hpdl" group across the hosts, against gloo's results (the
    bodies of test_torch_backend.py); the keys where they differ."""
    from torch_backend_bodies import collectives

    mine, theirs = collectives(None, "hpdl"), collectives(None, "gloo")
    assert mine.keys() == theirs.keys()
    differ = []
    for key, value in mine.items():
        other = theirs[key]
        same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
        if not same:
            differ.append(str(key))
    return differ


def pipeline(comm: hpdl.Communicator) -> dict:
    """Two stages, one per host (ranks 0 and 2, and 1 and 3: two pipelines), each over the whole batch."""
    from hpdl.parallel import Pipeline

    stages = comm.split(comm.local_rank, key=comm.rank)
    assert stages is not None
    pipe = Pipeline(list(make_model()), stages, chunks=3, schedule="1f1b", balance=[3, 2], checkpoint="never")
    opt = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9)
    x, y = data()
    for _ in range(STEPS):
        opt.zero_grad()
        pipe.step(x if pipe.is_first else None, y if pipe.is_last else None, nn.functional.mse_loss)
        opt.step()
    return {"first_layer": pipe.first_layer, "params": [p.detach().tolist() for p in pipe.parameters()]}


def zero3(comm: hpdl.Communicator) -> list:
    """ZeRO-3 over both hosts: every parameter sharded over the 4 ranks, each rank its quarter of the batch."""
    from hpdl.parallel import zero

    model, opt = zero(make_model(), comm, stage=3, optimizer=torch.optim.SGD, lr=LR, momentum=0.9)
    x, y = data()
    per = BATCH // comm.size
    xs, ys = x[comm.rank * per : (comm.rank + 1) * per], y[comm.rank * per : (comm.rank + 1) * per]
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
    return [p.tolist() for p in model.full_parameters().values()]


def kmeans(comm: hpdl.Communicator) -> list:
    """hpdl.ml's K-Means on the digits, each rank with its own rows (uneven: 1797 over 4)."""
    import numpy as np
    from sklearn.datasets import load_digits

    from hpdl.ml import KMeans

    X = load_digits().data
    mine = np.array_split(np.arange(len(X)), comm.size)[comm.rank]
    start = X[np.arange(10) * 150]
    return KMeans(10, init=start, n_init=1, comm=comm).fit(X[mine]).cluster_centers_.tolist()


if __name__ == "__main__":
    os.environ["JOB_SCRATCH"] = sys.argv[1]  # Lightning's folder
    comm = hpdl.init()
    result = {
        "rank": comm.rank,
        "size": comm.size,
        "host": socket.gethostname(),
        "local": [comm.local_rank, comm.local_size],
        "hosts": comm.hosts,
        "collectives": collectives(comm),
        "shm": comm.shm_status,  # type: ignore[attr-defined]
        "across_nodes": comm._cross is not None,  # type: ignore[attr-defined]
        "horovod": horovod()["params"],
        "pipeline": pipeline(comm),
        "zero3": zero3(comm),
        "kmeans": kmeans(comm),
        "ddp": ddp()["params"],
        "lightning": lightning()["params"],  # on the group ddp() made
        "fsdp2": fsdp2(None, "hpdl"),
        "torch_collectives_differ": torch_collectives(),
        "ucx_tls": os.environ.get("UCX_TLS"),
    }
    with open(os.path.join(sys.argv[1], f"rank-{comm.rank}.json"), "w") as out:
        json.dump(result, out)
    dist.destroy_process_group()
    hpdl.finalize()
