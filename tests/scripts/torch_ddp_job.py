"""A plain torch.distributed DDP script on the "hpdl" backend (used by test_torch_backend_training.py).

Launched with plain `mpiexec` (no hpdl launch, no MASTER_ADDR) and written
as a user's script is: it never imports hpdl before `init_process_group`
(torch's entry point registered the backend when torch was imported). It
trains, prints the largest difference from one process, and then, with
`raise`, the last rank fails so that the job must end with that rank's
traceback.
"""

import os
import sys

import numpy as np
import torch.distributed as dist

dist.init_process_group("hpdl")
print(f"rank {dist.get_rank()}: backend {dist.get_backend()} without importing hpdl", flush=True)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch_backend_training as training  # noqa: E402  (the shared training bodies, which do import hpdl)

params = training.ddp(None, "hpdl")
worst = max(float(np.abs(np.array(p) - np.array(r)).max()) for p, r in zip(params, training.reference()))
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: largest difference {worst:.3e}", flush=True)
dist.barrier()  # every rank has printed before the last one fails (a CI run lost a slower rank's line to the abort)
if sys.argv[1:] == ["raise"]:
    if dist.get_rank() == dist.get_world_size() - 1:
        raise ValueError("the last rank fails on purpose")
    dist.barrier()  # the others wait here and must be stopped
dist.destroy_process_group()
