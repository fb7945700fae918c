"""Full (logical) parameters of a tensor-parallel model, and loading full parameters into one.

The names are the plain model's (`parallelize` keeps them), so a state dict
gathered here loads into the plain model, and a plain state dict loads into
a tensor-parallel model on any tp size: the simplest resharding path.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from hpdl.comm.base import Communicator
from hpdl.parallel.tensor.shards import TPShard

__all__ = ["tp_shards", "full_state_dict", "load_full_state_dict"]


def tp_shards(model: nn.Module) -> dict[str, TPShard]:
    """Parameter name -> its `TPShard`, for the split parameters of `model` (replicated ones are absent)."""
    out = {}
    for prefix, module in model.named_modules():
        for pname, shard in getattr(module, "tp_shards", {}).items():
            out[f"{prefix}.{pname}" if prefix else pname] = shard
    return out


@torch.no_grad()
def full_state_dict(model: nn.Module, comm: Communicator) -> dict[str, torch.Tensor]:
    """Every entry of `model.state_dict()` at full size (split ones gathered over the tp `comm`); collective."""
    shards = tp_shards(model)
    out = {}
    for name, value in model.state_dict().items():
        shard = shards.get(name)
        if shard is None or comm.size == 1:
            out[name] = value.detach().clone()
            continue
        local = value.detach().contiguous()
        gathered = comm.allgather(local.reshape(1, -1), sizes=[1] * comm.size)
        out[name] = shard.assemble([row.view(shard.local_shape) for row in gathered])
    return out


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load full-size tensors into `model`, cutting this rank's slice of the split ones."""
    shards = tp_shards(model)
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    if missing:
        more = " ..." if len(missing) > 5 else ""
        raise KeyError(f"load_full_state_dict: the state has no {', '.join(missing[:5])}{more}")
    for name, target in own.items():
        value = state[name]
        shard = shards.get(name)
        target.copy_(shard.take(value) if shard is not None else value)
