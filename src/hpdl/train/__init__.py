"""Training loop, checkpoints, LR schedules and large-batch optimisers, for data parallelism and every plan.

    sampler = hpdl.train.DistributedSampler(len(train_set), comm, seed=0)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    model = hpdl.parallel.DataParallel(net, comm)
    trainer = hpdl.train.Trainer(model, optimizer, comm=comm, checkpoint="ckpt.pt")
    history = trainer.fit(loader, epochs=10, eval_loader=test_loader, resume="auto")

    trainer = hpdl.train.Trainer.from_plan(model, hpdl.parallel.Plan.from_file("plan.toml"), comm)  # any plan

See docs/train.md. The names below are imported on first use: they import torch, and `hpdl demo`'s
launcher (`hpdl.train.demo.launch`, which starts the ranks and waits) needs none of it. The package does
not import `hpdl.train.demo` either: its ranks run it with `python -m`, and runpy warns about a module
its package imported first.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_LAZY = {
    "DistributedSampler": "hpdl.train.sampler",
    "Trainer": "hpdl.train.trainer",
    "History": "hpdl.train.trainer",
    "NonFiniteLossError": "hpdl.train.trainer",
    "clip_grad_norm_": "hpdl.train.trainer",
    "LARS": "hpdl.train.optim",
    "LAMB": "hpdl.train.optim",
    "WarmupSchedule": "hpdl.train.schedule",
    "linear_scaled_lr": "hpdl.train.schedule",
    "save": "hpdl.train.checkpoint",
    "load": "hpdl.train.checkpoint",
    "Checkpoint": "hpdl.train.checkpoint",
    "CheckpointError": "hpdl.train.checkpoint",
    "Progress": "hpdl.train.progress",
}
"""Where each name lives: imported on first use."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hpdl.train' has no attribute {name!r}")
