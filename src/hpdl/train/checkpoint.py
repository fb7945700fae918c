"""Checkpoints that survive a kill and refuse to load into the wrong model.

`save` is collective when given a communicator: every rank's RNG states are
gathered (dropout and data augmentation draw from them), and rank 0 writes
one file *atomically*: into a temporary file in the same folder, flushed
and fsync'ed, then renamed over the old checkpoint with `os.replace`, and
the folder fsync'ed; a kill at any moment leaves either the old or the new
checkpoint, never half of one. Every rank leaves `save` after the file is
in place.

The file holds only tensors and plain Python values, so `load` reads it
with `torch.load(weights_only=True)` (no pickled code runs). torch's zip
container does not check the tensor bytes it reads, so the payload carries
a BLAKE2b digest of every key, value and tensor byte, recomputed on load:
a flipped byte anywhere is found, not trained on. A file that is
truncated or corrupt, that is not an hpdl checkpoint, or whose tensors do
not fit the model or optimizer raises `CheckpointError` naming the file and
the problem.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from hpdl.checkpoint.errors import CheckpointError
from hpdl.checkpoint.files import content_digest, unwrap, write_atomically

if TYPE_CHECKING:
    from hpdl.comm.base import Communicator

__all__ = ["save", "load", "CheckpointError", "Checkpoint", "unwrap", "rng_state", "set_rng_state"]

FORMAT = "hpdl-checkpoint"
VERSION = 1
log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    """What `load` returns besides the restored objects: where training stopped and the caller's extras."""

    path: str
    epoch: int
    step: int
    extra: dict[str, Any] = field(default_factory=dict)
    rng: Optional[dict[str, Any]] = None


# ---------------------------------------------------------------------------- RNG states as plain values
def rng_state() -> dict[str, Any]:
    """This process's torch (CPU and CUDA), NumPy and Python RNG states, as tensors and plain values."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": {"version": int(version), "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached"],
        )
    )
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"].tolist()), py["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------- save
def save(
    path: str,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    comm: Optional[Communicator] = None,
    epoch: int = 0,
    step: int = 0,
    scheduler: Any = None,
    scaler: Any = None,
    sampler: Any = None,
    extra: Optional[dict[str, Any]] = None,
) -> None:
    """Write a checkpoint of `model` (unwrapped), `optimizer` and friends to `path` (atomically, on rank 0).

    Collective with `comm`: call it on every rank. `epoch` and `step` say
    where training stands (the next epoch / global step to run); `extra`
    holds any tensors and plain values of the caller (for example the loss
    history). `scheduler`, `scaler` (GradScaler) and `sampler` are saved
    through their `state_dict()`.
    """
    states = [rng_state()] if comm is None else comm.allgather_object(rng_state())
    rank = 0 if comm is None else comm.rank
    if rank == 0:
        payload: dict[str, Any] = {
            "format": FORMAT,
            "version": VERSION,
            "epoch": int(epoch),
            "step": int(step),
            "world_size": 1 if comm is None else comm.size,
            "model": unwrap(model).state_dict(),
            "optimizer": None if optimizer is None else optimizer.state_dict(),
            "scheduler": None if scheduler is None else scheduler.state_dict(),
            "scaler": None if scaler is None else scaler.state_dict(),
            "sampler": None if sampler is None else sampler.state_dict(),
            "rng": states,
            "extra": dict(extra or {}),
        }
        payload["digest"] = content_digest(payload)
        write_atomically(path, payload)
        log.info("checkpoint written: %s (epoch %d, step %d)", path, epoch, step)
    if comm is not None:
        comm.barrier()


# ---------------------------------------------------------------------------- load
def read(path: str, map_location: Any = "cpu") -> dict[str, Any]:
    """The checkpoint's contents, checked to be an hpdl checkpoint; CheckpointError otherwise."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path}: no such file")
    size = os.path.getsize(path)
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {path} ({size} bytes) cannot be read: it is truncated or corrupt "
            f"({type(exc).__name__}: {_first_line(exc)}). Resume from an older checkpoint or start afresh."
        ) from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not an hpdl checkpoint (written by hpdl.train.save)")
    if payload.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {payload.get('version')}; this hpdl reads version {VERSION}"
        )
    digest = payload.pop("digest", None)
    if digest is None or digest != content_digest(payload):
        raise CheckpointError(
            f"checkpoint {path} ({size} bytes) is corrupt: its contents do not match the digest written with them. "
            "Resume from an older checkpoint or start afresh."
        )
    missing = [k for k in ("epoch", "step", "model", "rng") if k not in payload]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing)}: it is incomplete")
    return payload


def load(
    path: str,
    model: torch.nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    comm: Optional[Communicator] = None,
    scheduler: Any = None,
    scaler: Any = None,
    sampler: Any = None,
    restore_rng: bool = True,
    map_location: Any = "cpu",
) -> Checkpoint:
    """Restore what `save` wrote into `model`, `optimizer`, `scheduler`, `scaler`, `sampler`; return where it stopped.

    Every rank reads the file (it must be visible to all ranks: a shared or
    local copy). The model must have exactly the checkpoint's parameter and
    buffer names and shapes; otherwise CheckpointError lists every
    difference. `restore_rng=False` leaves the RNG states alone and returns
    them in `Checkpoint.rng` (the Trainer restores them at the right moment).
    """
    payload = read(path, map_location)
    target = unwrap(model)
    _check_model(path, target, payload["model"])
    target.load_state_dict(payload["model"])
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler), ("sampler", sampler)):
        if obj is None:
            continue
        state = payload.get(name)
        if state is None:
            raise CheckpointError(f"checkpoint {path} holds no {name} state, but a {name} was given to restore")
        try:
            obj.load_state_dict(state)
        except (ValueError, KeyError, RuntimeError, TypeError) as exc:
            raise CheckpointError(f"checkpoint {path}: its {name} state does not fit this {name}: {exc}") from exc
    rank = 0 if comm is None else comm.rank
    states = payload["rng"]
    mine = states[rank % len(states)] if states else None
    if states and len(states) != (1 if comm is None else comm.size):
        log.warning(
            "checkpoint %s was written by %d ranks, now %d: rank %d takes the RNG state of rank %d",
            path,
            len(states),
            1 if comm is None else comm.size,
            rank,
            rank % len(states),
        )
    if restore_rng and mine is not None:
        set_rng_state(mine)
    return Checkpoint(path, int(payload["epoch"]), int(payload["step"]), dict(payload.get("extra") or {}), mine)


def _check_model(path: str, model: torch.nn.Module, saved: dict[str, Any]) -> None:
    current = model.state_dict()
    problems = []
    for name in saved:
        if name not in current:
            problems.append(f"{name} is in the checkpoint but not in the model")
        elif tuple(saved[name].shape) != tuple(current[name].shape):
            problems.append(
                f"{name} has shape {tuple(saved[name].shape)} in the checkpoint but {tuple(current[name].shape)} "
                "in the model"
            )
    problems += [f"{name} is in the model but not in the checkpoint" for name in current if name not in saved]
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise CheckpointError(
            f"checkpoint {path} does not fit this model ({type(model).__name__}): {shown}. "
            "Build the model with the configuration of the saved run."
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else "no message"
