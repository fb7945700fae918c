"""Training loop, checkpoints, LR schedules and large-batch optimisers for (data-parallel) training.

    sampler = hpdl.train.DistributedSampler(len(train_set), comm, seed=0)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    model = hpdl.parallel.DataParallel(net, comm)
    trainer = hpdl.train.Trainer(model, optimizer, comm=comm, checkpoint="ckpt.pt")
    history = trainer.fit(loader, epochs=10, eval_loader=test_loader, resume="auto")

See docs/train.md. `hpdl demo` lives in `hpdl.train.demo`, which this package does not import:
its ranks run it with `python -m`, and runpy warns about a module its package imported first.
"""

from hpdl.train.checkpoint import Checkpoint, CheckpointError, load, save
from hpdl.train.optim import LAMB, LARS
from hpdl.train.progress import Progress
from hpdl.train.sampler import DistributedSampler
from hpdl.train.schedule import WarmupSchedule, linear_scaled_lr
from hpdl.train.trainer import History, NonFiniteLossError, Trainer, clip_grad_norm_

__all__ = [
    "DistributedSampler",
    "Trainer",
    "History",
    "NonFiniteLossError",
    "clip_grad_norm_",
    "LARS",
    "LAMB",
    "WarmupSchedule",
    "linear_scaled_lr",
    "save",
    "load",
    "Checkpoint",
    "CheckpointError",
    "Progress",
]
