"""Horovod's helpers for model and optimizer state: broadcast_parameters, broadcast_optimizer_state,
broadcast_object, allgather_object (all named operations of the engine, so they are checked too)."""

from __future__ import annotations

import io
import pickle
from typing import Any, Optional

import torch

from hpdl.horovod import ops
from hpdl.horovod.process_sets import ProcessSet, global_process_set, resolve

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def broadcast_parameters(params: Any, root_rank: int, prefix: Optional[str] = None) -> None:
    """Copy `root_rank`'s parameters into every rank's, in place.

    `params`: a `state_dict()`, `named_parameters()` or a list of (name, tensor) pairs.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list) or hasattr(params, "__iter__"):
        items = list(params)
        for entry in items:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise ValueError("broadcast_parameters takes a state_dict, named_parameters() or (name, tensor) pairs")
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = []
    for name, p in items:
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name!r} is a {type(p).__name__}, not a tensor")
        key = f"{prefix}.{name}" if prefix else str(name)
        handles.append(ops.broadcast_async_(p, root_rank, name=f"broadcast_parameters.{key}"))
    for handle in handles:
        ops.synchronize(handle)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None, prefix: Optional[str] = None
) -> None:
    """Make every rank's optimizer state (moments, step counts, hyperparameters) equal `root_rank`'s.

    Sent as one pickled `state_dict` (run once at the start or after loading a checkpoint).
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    from hpdl.horovod import basics

    if not optimizer.state_dict()["state"]:
        _initialize_state(optimizer)

    state = broadcast_object(
        optimizer.state_dict() if basics.rank() == root_rank else None, root_rank, name="broadcast_optimizer_state"
    )
    if basics.rank() != root_rank:
        optimizer.load_state_dict(state)


def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """A fresh optimizer gets zero gradients, as Horovod gives it (scripts read `p.grad` afterwards).

    Horovod also takes one optimizer step on them to create the state; hpdl does not: that step
    advances Adam's step count, so the run would no longer match one process. The state comes from
    the root when it has one, and is created by the first real step otherwise (the same on every rank).
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam):
                    p.grad = p.grad.to_sparse()


def _dumps(obj: Any) -> torch.Tensor:
    try:
        import cloudpickle

        data = cloudpickle.dumps(obj)
    except ImportError:
        data = pickle.dumps(obj)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _part(name: Optional[str], part: str) -> Optional[str]:
    return None if name is None else f"{name}.{part}"


def _loads(t: torch.Tensor) -> Any:
    return pickle.load(io.BytesIO(t.numpy().tobytes()))


def broadcast_object(
    obj: Any, root_rank: int = 0, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> Any:
    """Any picklable object from `root_rank` (a world rank), on every rank of the set."""
    from hpdl.horovod import basics

    resolve(process_set, "broadcast_object")
    payload = _dumps(obj) if basics.rank() == root_rank else torch.empty(0, dtype=torch.uint8)
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    ops.broadcast_(length, root_rank, name=_part(name, "sz"), process_set=process_set)
    if basics.rank() != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    ops.broadcast_(payload, root_rank, name=_part(name, "t"), process_set=process_set)
    return obj if basics.rank() == root_rank else _loads(payload)


def allgather_object(obj: Any, name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> list:
    """Every rank's picklable object, in a list ordered by rank within the set."""
    resolve(process_set, "allgather_object")
    payload = _dumps(obj)
    sizes = ops.allgather(
        torch.tensor([payload.numel()], dtype=torch.int64), name=_part(name, "sz"), process_set=process_set
    )
    gathered = ops.allgather(payload, name=_part(name, "t"), process_set=process_set)
    out, start = [], 0
    for n in sizes.tolist():
        out.append(_loads(gathered[start : start + n]))
        start += n
    return out
