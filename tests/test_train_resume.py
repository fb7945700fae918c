"""Resume after a kill: a run killed mid-epoch and resumed from its last checkpoint repeats the uninterrupted losses.

The training job is this file run as a script (`python test_train_resume.py
CHECKPOINT OUT KILL_AT`): a model with dropout (so the RNG state matters),
shuffled batches, SGD with momentum and a warm-up schedule, a checkpoint
every 3 steps. With KILL_AT > 0 the process SIGKILLs itself in the forward
pass of that global step, like a node failure: no cleanup, no final save.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

HERE = os.path.abspath(__file__)
EPOCHS = 3


def job(checkpoint: str, out: str, kill_at: int) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from hpdl.train import DistributedSampler, Trainer, WarmupSchedule

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(100, 6, generator=g), torch.randint(0, 4, (100,), generator=g))
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 4))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=7))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scheduler = WarmupSchedule(optimizer, 5, start_factor=0.1, total_steps=EPOCHS * len(loader), decay="cosine")
    trainer: Trainer

    def loss_fn(output, target):
        if kill_at and trainer.global_step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.nn.functional.cross_entropy(output, target)

    trainer = Trainer(
        model, optimizer, loss_fn, scheduler=scheduler, checkpoint=checkpoint, checkpoint_every=3, progress=False
    )
    resumed = os.path.exists(checkpoint)
    start = 0
    if resumed:
        start = trainer.restore(checkpoint).step
    history = trainer.fit(loader, EPOCHS)
    with open(out, "w") as handle:
        json.dump({"losses": history.losses, "resumed_at": start if resumed else None}, handle)


def _run(tmp_path, name: str, kill_at: int = 0) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, HERE, str(tmp_path / f"{name}.pt"), str(tmp_path / f"{name}.json"), str(kill_at)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_resume_after_kill_continues_the_same_trajectory(tmp_path):
    whole = _run(tmp_path, "whole")
    assert whole.returncode == 0, whole.stderr
    reference = json.load(open(tmp_path / "whole.json"))
    assert reference["resumed_at"] is None and len(reference["losses"]) == EPOCHS * 13

    killed = _run(tmp_path, "broken", kill_at=17)  # in epoch 2 (13 steps each), after the checkpoint of step 15
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (tmp_path / "broken.json").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".broken")] == [], "no temporary file is left"

    resumed = _run(tmp_path, "broken")
    assert resumed.returncode == 0, resumed.stderr
    result = json.load(open(tmp_path / "broken.json"))
    assert result["resumed_at"] == 15
    assert len(result["losses"]) == len(reference["losses"])
    assert result["losses"] == pytest.approx(reference["losses"], rel=1e-6, abs=1e-7)


if __name__ == "__main__":
    job(sys.argv[1], sys.argv[2], int(sys.argv[3]))
