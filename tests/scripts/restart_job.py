"""A training script with nothing about restarts in it, as test_multihost.py runs it under `--max-restarts`.

`python restart_job.py FOLDER`: DataParallel + Trainer on the float64 MLP of torch_backend_training.py, a
checkpoint every 2 steps in FOLDER/ckpt.pt, losses written to FOLDER/losses-<restart>.json by rank 0. The only
lines for the test: a restarted run first copies the checkpoint it will resume from (FOLDER/resumed-from.pt), and
RESUME_FROM (the test's reference run) resumes from a given file into another folder.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import hpdl
from hpdl.parallel import DataParallel
from hpdl.runtime.environment import restart_count
from hpdl.train import DistributedSampler, Trainer
from torch_backend_training import make_model


class Slow(nn.Module):
    """A step long enough for the test to pull a link in the middle of training: the first run's (the restarted
    one and the test's reference run need no time to pull a link in)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if restart_count() == 0 and not os.environ.get("RESUME_FROM"):
            time.sleep(0.05)
        return x


folder = sys.argv[1]
comm = hpdl.init()
gen = torch.Generator().manual_seed(5)
x, y = torch.randn(384, 6, generator=gen, dtype=torch.float64), torch.randn(384, 3, generator=gen, dtype=torch.float64)
data = TensorDataset(x, y)
loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, comm, seed=0))
model = DataParallel(nn.Sequential(Slow(), *make_model()), comm)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
checkpoint = os.path.join(folder, "ckpt.pt")
if comm.rank == 0 and restart_count() > 0:
    shutil.copy(checkpoint, os.path.join(folder, "resumed-from.pt"))
comm.barrier()
trainer = Trainer(
    model, optimizer, comm=comm, checkpoint=checkpoint, checkpoint_every=2, loss_fn=nn.functional.mse_loss
)
history = trainer.fit(loader, 3, resume=os.environ.get("RESUME_FROM"))
if comm.rank == 0:
    with open(os.path.join(folder, f"losses-{restart_count()}.json"), "w") as out:
        json.dump({"losses": history.losses, "ranks": comm.size, "host": os.uname().nodename}, out)
hpdl.finalize()
