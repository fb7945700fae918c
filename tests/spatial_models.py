"""Small CNNs and training loops shared by the spatial-parallel tests (one process and N ranks)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

STEPS, BATCH, CLASSES = 5, 2, 3


def make_net(nd: int = 2, batch_norm: bool = True) -> nn.Sequential:
    """Stride-2, dilated, grouped convs; zeros/reflect/replicate/circular padding; pooling, BN, linear head."""
    conv = {2: nn.Conv2d, 3: nn.Conv3d}[nd]
    bn = {2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[nd] if batch_norm else (lambda c: nn.Identity())
    maxpool = {2: nn.MaxPool2d, 3: nn.MaxPool3d}[nd]
    avgpool = {2: nn.AvgPool2d, 3: nn.AvgPool3d}[nd]
    gap = {2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}[nd]
    torch.manual_seed(0)
    return nn.Sequential(
        conv(2, 4, 3, padding=1, bias=not batch_norm),  # a bias before BN gets only rounding noise
        bn(4),
        nn.ReLU(),
        conv(4, 6, 3, stride=2, padding=1, padding_mode="reflect"),
        nn.Tanh(),
        conv(6, 6, 3, padding=2, dilation=2, groups=2, padding_mode="replicate", bias=not batch_norm),
        bn(6),
        nn.ReLU(),
        maxpool(3, stride=2, padding=1),
        conv(6, 4, (3,) * nd, padding=1, padding_mode="circular"),
        nn.SiLU(),
        avgpool(2),
        gap(1),
        nn.Flatten(),
        nn.Linear(4, CLASSES),
    ).double()


def make_data(shape: tuple[int, ...], steps: int = STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn((steps, BATCH, 2, *shape), generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (steps, BATCH), generator=g)
    return x, y


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, opt_name: str, prepare: Optional[Any] = None) -> dict:
    """5 steps; returns the first output, the losses, the first input gradient and weight gradients, the final state."""
    opt = make_optimizer(opt_name, model.parameters())
    out: dict[str, Any] = {"losses": []}
    for step in range(x.shape[0]):
        xs = x[step] if prepare is None else prepare(x[step])
        xs = xs.clone().requires_grad_(True)
        opt.zero_grad()
        logits = model(xs)
        loss = F.cross_entropy(logits, y[step])
        loss.backward()
        if step == 0:
            out["logits"] = logits.detach().clone()
            out["input_grad"] = xs.grad.detach().clone()
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        out["losses"].append(float(loss.detach()))
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out
