"""One training loop for every plan: `Trainer` and `hpdl train` against one process (float64, 1e-10).

Each plan kind (dp, a pipeline of 2 stages with micro-batches, tp=2 with a vocabulary-parallel head,
spatial, dp x pp with ZeRO-1) trains the same model on the same global batches as one process; the
parameters and every step's loss must match. Two of them stop after an epoch, write a sharded checkpoint,
and resume as a job restarted by `hpdl launch --max-restarts` does (HPDL_RESTART_COUNT).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hpdl.checkpoint.format import METADATA
from hpdl.parallel import Plan
from hpdl.parallel.mesh import full_state
from hpdl.runtime.environment import RESTART_COUNT
from hpdl.train import Trainer
from train_plan_models import cnn, loader, mlp, one_process

TOL = 1e-10
EPOCHS = 2
PLANS = {
    "dp": (2, Plan(dp=2)),
    "pp2": (2, Plan(dp=1, pp=2, micro_batches=2)),
    "tp2": (2, Plan(dp=1, tp=2)),
    "spatial": (2, Plan(dp=1, sp=2)),
    "dp2xpp2-zero1": (4, Plan(dp=2, pp=2, micro_batches=2, zero_stage=1)),
}
RESUMED = ("pp2", "dp2xpp2-zero1")
TESTS = Path(__file__).resolve().parent


def trainer_for(comm, kind: str, folder: str) -> Trainer:
    model = cnn() if kind == "spatial" else mlp()
    optimizer = {"optimizer": torch.optim.SGD, "optimizer_options": {"lr": 0.1, "momentum": 0.9}}
    return Trainer.from_plan(model, PLANS[kind][1], comm, **optimizer, checkpoint=folder, progress=False)


class Counted(list):
    """The batches, counting how many the loop read (a resumed run reads only the epochs left)."""

    read = 0

    def __iter__(self):
        for batch in super().__iter__():
            self.read += 1
            yield batch


def train_on_plan(comm, kind: str, folder: str):
    """EPOCHS epochs on this plan (resumed kinds: one, then a restarted job's run); the full state, the losses
    and the batches read by the last run."""
    trainer = trainer_for(comm, kind, folder)
    mesh = trainer.layout.mesh
    data = Counted(loader(mesh.dp.rank, mesh.dp.size, "cnn" if kind == "spatial" else "mlp"))
    if kind in RESUMED:
        trainer.fit(data, 1)
        mesh.close()
        trainer = trainer_for(comm, kind, folder)  # a fresh model and optimizer, as in a restarted job
        mesh = trainer.layout.mesh
        data.read = 0
        os.environ[RESTART_COUNT] = "1"
        try:
            trainer.fit(data, EPOCHS)
        finally:
            del os.environ[RESTART_COUNT]
    else:
        trainer.fit(data, EPOCHS)
    state = full_state(trainer.model, trainer.optimizer, mesh)["model"]
    mesh.close()
    return state, trainer.history.losses, data.read


def reference(kind: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = "cnn" if kind == "spatial" else "mlp"
    return one_process(cnn() if model == "cnn" else mlp(), loader(model=model), EPOCHS)


@pytest.mark.parametrize("kind", list(PLANS))
def test_every_plan_kind_trains_like_one_process(ranks, kind, tmp_path):
    want, want_losses = reference(kind)
    size = PLANS[kind][0]
    for rank, (state, losses, read) in enumerate(
        ranks("mpi", size).run(train_on_plan, kind, str(tmp_path), timeout=120)
    ):
        assert len(losses) == len(want_losses) == 4 and read == (2 if kind in RESUMED else 4), (rank, read)
        assert state.keys() == want.keys(), rank
        for name, value in want.items():
            assert float((state[name] - value).abs().max()) <= TOL, (kind, rank, name)
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= TOL, (kind, rank, losses, want_losses)
    if kind in RESUMED:
        assert (tmp_path / METADATA).exists()  # the sharded folder the restarted job resumed from


def hpdl_train(comm, argv: list[str]) -> int:
    """`hpdl train ...` on a pool's ranks, without -n: each rank is one of the job's (the world is the pool's)."""
    from hpdl.cli.main import main

    return main(["train", *argv])


def test_hpdl_train_runs_a_plan_file_with_no_code(ranks, tmp_path):
    """`hpdl train --plan plan.toml`: a planner's file, a model factory and a loader; nothing else."""
    plan = tmp_path / "plan.toml"
    Plan(dp=1, pp=2, micro_batches=2).to_file(str(plan))
    out = tmp_path / "history.json"
    argv = ["--model", "train_plan_models:mlp", "--data", "train_plan_models:loader", "--plan", str(plan),
            "--epochs", str(EPOCHS), "--optimizer", "SGD", "--lr", "0.1", "--momentum", "0.9",
            "--eval-data", "train_plan_models:loader", "--history", str(out)]  # fmt: skip
    assert ranks("mpi", 2).run(hpdl_train, argv, timeout=120) == [0, 0]
    model = mlp()
    _, want_losses = one_process(model, loader(), EPOCHS)
    with torch.no_grad():  # the evaluation after the last epoch: the trained model on the same batches
        outputs = [(model(x), y) for x, y in loader()]
    want_eval = sum(float(torch.nn.functional.cross_entropy(o, y)) * len(y) for o, y in outputs) / 16
    want_accuracy = sum(int((o.argmax(1) == y).sum()) for o, y in outputs) / 16
    history = json.loads(out.read_text())
    assert len(history["losses"]) == 4 and max(abs(a - b) for a, b in zip(history["losses"], want_losses)) <= TOL
    assert [e["epoch"] for e in history["epochs"]] == [1, 2] and history["epochs"][-1]["samples"] == 16
    last = history["epochs"][-1]  # counted once per replica, on the last stage
    assert last["eval_samples"] == 16 and abs(last["eval_loss"] - want_eval) <= TOL
    assert last["eval_accuracy"] == want_accuracy


def test_hpdl_train_refuses_bad_options_before_starting_ranks(capsys):
    from hpdl.cli.main import main

    assert main(["train", "-n", "2", "--model", "m:f", "--data", "m:g", "--plan", "p.toml", "--epochs", "0"]) == 2
    assert "--epochs: '0' must be positive" in capsys.readouterr().err
