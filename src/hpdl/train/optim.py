"""Large-batch optimisers: LARS (You, Gitman, Ginsburg 2017) and LAMB (You et al. 2019).

Both scale each layer's update by a *trust ratio* ||w|| / ||update||, so
that no layer moves by more than a fixed fraction of its own norm however
large the learning rate that the global batch calls for. Put biases and
normalisation parameters in a group with `weight_decay=0` and
`adapt=False` (no trust ratio), as the papers do.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch.optim import Optimizer

__all__ = ["LARS", "LAMB"]

Params = Union[Iterable[torch.Tensor], Iterable[dict[str, Any]]]


def _trust_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`scale` where both norms are positive, else 1 (a zero tensor or a zero update is left unscaled)."""
    return torch.where((w_norm > 0) & (u_norm > 0), scale, torch.ones_like(scale))


class LARS(Optimizer):
    """Layer-wise Adaptive Rate Scaling, Algorithm 1 of You et al. 2017 (arXiv:1708.03888).

    For each parameter w with gradient g, weight decay beta and trust
    coefficient eta:

        local_lr = eta * ||w|| / (||g|| + beta * ||w|| + eps)   (1 where ||w|| or ||g|| is 0)
        v        = momentum * v + lr * local_lr * (g + beta * w)
        w        = w - v

    A group with `adapt=False` uses local_lr = 1 (plain SGD with momentum
    and weight decay): meant for biases and batch-norm parameters.
    """

    def __init__(
        self,
        params: Params,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        adapt: bool = True,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"LARS: lr={lr} must be positive")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"LARS: momentum={momentum} must be in [0, 1)")
        if weight_decay < 0 or trust_coefficient <= 0 or eps < 0:
            raise ValueError(
                f"LARS: weight_decay={weight_decay} >= 0, trust_coefficient={trust_coefficient} > 0 and "
                f"eps={eps} >= 0 are required"
            )
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            adapt=adapt,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            decay, momentum = group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                update = g.add(p, alpha=decay) if decay else g.clone()
                if group["adapt"]:
                    w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
                    scale = group["trust_coefficient"] * w_norm / (g_norm + decay * w_norm + group["eps"])
                    update.mul_(_trust_ratio(w_norm, g_norm, scale))
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(momentum).add_(update, alpha=group["lr"])
                p.sub_(buf)
        return loss


class LAMB(Optimizer):
    """Layer-wise Adaptive Moments for Batch training, Algorithm 2 of You et al. 2019 (arXiv:1904.00962).

    With step t, moments m and v, weight decay lambda:

        m = beta1 * m + (1 - beta1) * g;      v = beta2 * v + (1 - beta2) * g^2
        m_hat = m / (1 - beta1^t);            v_hat = v / (1 - beta2^t)     (bias_correction=True)
        u = m_hat / (sqrt(v_hat) + eps) + lambda * w
        w = w - lr * (||w|| / ||u||) * u       (ratio 1 where ||w|| or ||u|| is 0; capped at max_trust)

    A group with `adapt=False` uses ratio 1 (AdamW-like): meant for biases and
    normalisation parameters.
    """

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        max_trust: Optional[float] = None,
        adapt: bool = True,
    ) -> None:
        if lr <= 0:
            raise ValueError(f"LAMB: lr={lr} must be positive")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"LAMB: betas={betas} must each be in [0, 1)")
        if eps < 0 or weight_decay < 0 or (max_trust is not None and max_trust <= 0):
            raise ValueError(f"LAMB: eps={eps} >= 0, weight_decay={weight_decay} >= 0 and max_trust > 0 are required")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            max_trust=max_trust,
            adapt=adapt,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                if group["bias_correction"]:
                    m_hat = m / (1 - beta1 ** state["step"])
                    v_hat = v / (1 - beta2 ** state["step"])
                else:
                    m_hat, v_hat = m, v
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                if group["adapt"]:
                    w_norm, u_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(update)
                    ratio = _trust_ratio(w_norm, u_norm, w_norm / u_norm.clamp_min(torch.finfo(u_norm.dtype).tiny))
                    if group["max_trust"] is not None:
                        ratio = ratio.clamp_max(group["max_trust"])
                    update.mul_(ratio)
                p.sub_(update, alpha=group["lr"])
        return loss
