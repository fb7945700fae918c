"""Models and data for tests/test_train_plans.py and its `hpdl train` run (`--model train_plan_models:mlp`).

float64, seeded: every rank builds the same model, and each data-parallel replica reads its rows of the
same global batches, so N ranks on any plan equal one process on the whole batches.
"""

from __future__ import annotations

import torch
from torch import nn

STEPS, BATCH, FEATURES, CLASSES = 2, 8, 6, 4


def mlp() -> nn.Sequential:
    """Five layers (a pipeline splits them); tp splits the head's classes (the loss is then vocabulary-parallel)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, CLASSES)
    ).double()  # fmt: skip
    model.tp_plan = {"0": "column", "2": "row", "4": "column"}  # type: ignore[assignment]
    return model


def cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.Tanh(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, CLASSES),
    ).double()  # fmt: skip


def batches(model: str = "mlp") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches, the same in every process."""
    g = torch.Generator().manual_seed(1)
    shape = (FEATURES,) if model == "mlp" else (2, 8, 8)
    return [
        (torch.randn(BATCH, *shape, generator=g, dtype=torch.float64), torch.randint(0, CLASSES, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def loader(rank: int = 0, size: int = 1, model: str = "mlp") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Replica `rank` of `size`'s rows of every global batch (`hpdl train --data train_plan_models:loader`)."""
    per = BATCH // size
    return [(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]) for x, y in batches(model)]


def one_process(model: nn.Module, data: list, epochs: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The reference: SGD with momentum on the whole batches; the final state and every step's loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(epochs):
        for x, y in data:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses
