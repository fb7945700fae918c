"""An unmodified torchrun-style script: torch's own `init_process_group("gloo")` (env://), no hpdl call at all
(but with the argument `hpdl`: then `hpdl.init("torch")` on that group)."""

import sys

import torch
import torch.distributed as dist
from listeners import listening_addresses

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
x = torch.ones(4) * (rank + 1)
dist.all_reduce(x)
print(f"rank {rank} of {size}: sum {x[0].item():.0f}", flush=True)
if sys.argv[1:] == ["hpdl"]:  # hpdl on the script's own group: its store carries hpdl's progress reports
    import time

    import hpdl

    comm = hpdl.init("torch")
    comm.allreduce(x)
    print(f"rank {rank}: hpdl sum {x[0].item():.0f}", flush=True)
    if rank == 0:
        time.sleep(30)  # never calls the next collective: stopped when rank 1's error ends the job
    comm.timeout = 2.0
    comm.allreduce(x)  # rank 1: a CommTimeoutError naming rank 0
if sys.argv[1:] == ["listeners"]:
    print(f"rank {rank} listens on {sorted(listening_addresses())}", flush=True)
    dist.barrier()  # every rank has looked before any leaves
dist.destroy_process_group()
