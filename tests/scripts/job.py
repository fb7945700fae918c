"""A small job whose behaviour is chosen by its first argument (used by test_launcher.py)."""

import os
import sys
import time

import torch
from listeners import listening_addresses  # beside this script: found as `python job.py` finds it

import hpdl

mode = sys.argv[1]
comm = hpdl.init(timeout=float(os.environ.get("JOB_TIMEOUT", "60")))
print(f"rank {comm.rank} of {comm.size} on {comm.backend} started at {time.time():.3f}", flush=True)
if comm.backend == "mpi" and comm.rank == 0:  # its node segment's name, which MPICH takes from its launcher's pid
    from hpdl.runtime.spawn import forker_segment_prefix

    print(f"segment {forker_segment_prefix(os.getppid())}", flush=True)
x = torch.ones(4) * (comm.rank + 1)
comm.allreduce(x)
if mode == "ok":
    print(f"sum {x[0].item():.0f} in µs → ✓", flush=True)  # non-ASCII: MPICH's gforker relay would drop it
    print(f"rank {comm.rank} still heard", flush=True)
    print(f"rank {comm.rank} stderr: ±", file=sys.stderr, flush=True)
    print(f"rank {comm.rank} listens on {sorted(listening_addresses())}", flush=True)
    comm.barrier()  # every rank has looked before any leaves
elif mode == "raise":
    if comm.rank == comm.size - 1:
        raise RuntimeError("boom on the last rank")
    comm.allreduce(x)  # the others wait here and must be stopped
elif mode == "exit3":
    if comm.rank == 0:
        sys.exit(3)
    time.sleep(30)  # must be stopped by the launcher
elif mode == "fail4":  # one rank fails in the user's code, the others wait in collectives and are stopped
    if comm.rank == 2:
        raise ValueError(f"bad batch on rank {comm.rank}")
    while True:
        comm.barrier()
        time.sleep(0.05)
elif mode == "killed":  # a rank killed from outside (the OOM killer, kill -9): it cannot say why itself
    if comm.rank == 1:
        os.kill(os.getpid(), 9)
    while True:
        comm.barrier()
        time.sleep(0.05)
elif mode == "sleep":
    print(f"rank {comm.rank} sleeping", flush=True)
    time.sleep(60)
elif mode == "die":
    if comm.rank == comm.size - 1:
        os._exit(9)  # dies without a word, mid-job
    comm.allreduce(x)
elif mode == "noexit":
    pass  # ends without finalize: hpdl must still leave the backend cleanly
elif mode == "argv":
    if comm.rank == 0:
        print("argv", sys.argv[2:], flush=True)
if mode != "noexit":
    hpdl.finalize()
