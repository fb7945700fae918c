"""`save` / `load` of sharded checkpoints for ZeRO, DataParallel and plain models, and a single-file `export`.

`save` is collective over the model's communicator: each rank writes the
chunks it holds (ZeRO: its pieces of every parameter and of the optimizer
state; replicated models: rank 0 writes everything), then rank 0 writes the
metadata (`hpdl.checkpoint.format`). `load` asks, for the layout it is given
now, for exactly the parts each rank needs (`ShardReader`), whatever layout
and rank count wrote them: ZeRO stage 3 on 4 ranks loads into stage 1 on 2,
into DataParallel, or into one plain process, with no conversion step.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from typing import Any, Optional, Sequence

import torch
from torch import nn

from hpdl.checkpoint.format import METADATA, shard_name, write_metadata, write_shard
from hpdl.checkpoint.reader import ShardReader
from hpdl.comm.base import Communicator
from hpdl.train.checkpoint import CheckpointError, _write_atomically, unwrap

__all__ = ["save", "load", "export", "ShardWriter", "new_writer", "commit"]

log = logging.getLogger(__name__)


def _zero_parts(model: nn.Module, optimizer: Any) -> tuple[Any, Any]:
    from hpdl.parallel.zero import ZeroModel, ZeroOptimizer

    zmodel = model if isinstance(model, ZeroModel) else None
    zopt = optimizer if isinstance(optimizer, ZeroOptimizer) else None
    if zopt is not None and zmodel is None:
        raise TypeError("a ZeroOptimizer is saved and loaded with the ZeroModel that zero() returned with it")
    return zmodel, zopt


def _comm_of(model: nn.Module, comm: Optional[Communicator]) -> Optional[Communicator]:
    if comm is not None:
        return comm
    found = getattr(model, "comm", None)
    return found if isinstance(found, Communicator) else None


# ---------------------------------------------------------------------------- save
class ShardWriter:
    """This rank's chunks of logical tensors and their metadata entries; `commit` writes them (collective).

    Other layouts (tensor, pipeline parallel) save through it too: `add` a
    chunk with the part of the logical tensor it holds, as a flat range of
    the row-major flattening or as an N-d box.
    """

    def __init__(self, rank: int, size: int, save_id: str):
        self.rank = rank
        self.file = shard_name(rank, size, save_id)
        self.tensors: dict[str, torch.Tensor] = {}
        self.entries: dict[str, dict[str, Any]] = {}
        self.values: dict[str, Any] = {}
        """Plain (non-tensor) per-parameter values, for example an optimizer's state that is not a tensor."""

    def add(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        t: torch.Tensor,
        *,
        flat: Optional[tuple[int, int]] = None,
        box: Optional[Sequence[tuple[int, int]]] = None,
        kind: str = "param",
    ) -> None:
        """Record chunk `t` of logical tensor `name` (global `shape`, `dtype`): elements `flat` = (start, stop) of
        its flattening, or the `box` ((start, stop) per dimension); the whole tensor when neither is given."""
        if flat is not None and box is not None:
            raise ValueError(f"{name}: give a chunk's flat range or its box, not both")
        if box is not None:
            region: dict[str, Any] = {"box": tuple((int(a), int(b)) for a, b in box)}
            key = f"{name}@" + ",".join(f"{a}" for a, _ in region["box"])
        else:
            lo, hi = flat if flat is not None else (0, math.prod(shape))
            region = {"flat": (int(lo), int(hi))}
            key = f"{name}@{lo}"
        self.tensors[key] = t.detach().to("cpu").contiguous().clone()
        entry = self.entries.setdefault(
            name, {"shape": tuple(shape), "dtype": str(dtype).replace("torch.", ""), "chunks": [], "kind": kind}
        )
        entry["chunks"].append({"file": self.file, "key": key, **region})


def new_writer(path: str, comm: Optional[Communicator]) -> ShardWriter:
    """A ShardWriter for this rank with a save id shared by all ranks (collective with `comm`)."""
    rank, size = (0, 1) if comm is None else (comm.rank, comm.size)
    save_id = secrets.token_hex(4) if rank == 0 else ""
    if comm is not None and size > 1:
        save_id = comm.broadcast_object(save_id)
    os.makedirs(path, exist_ok=True)
    return ShardWriter(rank, size, save_id)


def commit(
    path: str,
    writer: ShardWriter,
    comm: Optional[Communicator],
    *,
    layout: dict[str, Any],
    optimizer: Optional[dict[str, Any]] = None,
    extra: Optional[dict[str, Any]] = None,
) -> None:
    """Write this rank's shard, then (rank 0) the metadata of every rank's chunks, last; collective with `comm`.

    `layout` describes the writer (strategy, degrees); `optimizer` is
    {"class", "param_groups", "values"} or None; `extra` the caller's values.
    """
    size = 1 if comm is None else comm.size
    file_entry = write_shard(path, writer.file, writer.tensors)
    file_entry["rank"] = writer.rank
    mine = (writer.file, file_entry, writer.entries, writer.values)
    gathered = [mine] if comm is None or size == 1 else comm.allgather_object(mine)
    if writer.rank == 0:
        tensors: dict[str, dict[str, Any]] = {}
        files: dict[str, Any] = {}
        values: dict[str, Any] = {}
        for file, entry, entries, vals in gathered:
            files[file] = entry
            values.update(vals)
            for name, e in entries.items():
                merged = tensors.setdefault(name, {k: v for k, v in e.items() if k != "chunks"} | {"chunks": []})
                merged["chunks"].extend(e["chunks"])
        if optimizer is not None:
            optimizer = {**optimizer, "values": {**optimizer.get("values", {}), **values}}
        metadata = {
            "world_size": size,
            "layout": {**layout, "world_size": size},
            "files": files,
            "tensors": tensors,
            "optimizer": optimizer,
            "extra": dict(extra or {}),
        }
        old = _listed_files(path)
        write_metadata(path, metadata)
        for name in old - set(files):  # the previous save's shards, now unreferenced
            try:
                os.remove(os.path.join(path, name))
            except OSError:
                pass
    if comm is not None and size > 1:
        comm.barrier()


def save(
    path: str,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    comm: Optional[Communicator] = None,
    extra: Optional[dict[str, Any]] = None,
) -> None:
    """Write a sharded checkpoint of `model` and `optimizer` into the folder `path` (collective).

    `model` is a ZeroModel (with its ZeroOptimizer), a DataParallel or a
    plain module; the communicator is the model's own unless `comm` is
    given. `extra` holds the caller's plain values and tensors (epoch,
    step, loss history): it is stored in the metadata and returned by `load`.
    """
    comm = _comm_of(model, comm)
    writer = new_writer(path, comm)
    zmodel, zopt = _zero_parts(model, optimizer)
    if zmodel is not None:
        _collect_zero(writer, zmodel, zopt)
        layout: dict[str, Any] = {"strategy": "zero", "stage": zmodel.stage}
    else:
        if writer.rank == 0:
            _collect_plain(writer, unwrap(model), optimizer)
        layout = {"strategy": type(model).__name__}
    commit(path, writer, comm, layout=layout, optimizer=_optimizer_meta(optimizer, zopt), extra=extra)
    log.info("sharded checkpoint written: %s", path)


def _listed_files(path: str) -> set[str]:
    if not os.path.exists(os.path.join(path, METADATA)):
        return set()
    try:
        from hpdl.checkpoint.format import read_metadata

        return set(read_metadata(path)["files"])
    except CheckpointError:
        return set()


def _collect_zero(writer: ShardWriter, zmodel: Any, zopt: Any) -> None:
    values = writer.values
    for buffers in zmodel.shards:
        for piece in buffers.pieces:
            slot = buffers.unit.slots[piece.index]
            chunk = buffers.master[piece.shard_offset : piece.shard_offset + piece.numel]
            writer.add(f"model/{piece.name}", slot.shape, buffers.master.dtype, chunk, flat=(piece.start, piece.stop))
    if writer.rank == 0:  # replicated: buffers and frozen parameters
        sharded = set(zmodel.master_dtypes)
        for name, t in zmodel.module.state_dict().items():
            if name not in sharded:
                writer.add(f"model/{name}", tuple(t.shape), t.dtype, t, kind="replicated")
    if zopt is None:
        return
    shapes = {s.name: s.shape for b in zmodel.shards for s in b.unit.slots}
    for name, start, stop, state in zopt.piece_states():
        for key, value in state.items():
            logical = f"optim/{name}/{key}"
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == stop - start and key != "step":
                writer.add(logical, shapes[name], value.dtype, value, flat=(start, stop), kind="elementwise")
            elif start == 0:  # one copy of per-parameter values: from the rank holding its first element
                if isinstance(value, torch.Tensor):
                    writer.add(logical, tuple(value.shape), value.dtype, value, kind="whole")
                else:
                    values[logical] = value


def _collect_plain(writer: ShardWriter, module: nn.Module, optimizer: Any) -> None:
    values = writer.values
    params = dict(module.named_parameters())
    for name, t in module.state_dict().items():
        writer.add(f"model/{name}", tuple(t.shape), t.dtype, t, kind="param" if name in params else "replicated")
    if optimizer is None:
        return
    names = {id(p): n for n, p in module.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise CheckpointError("the optimizer holds a parameter that is not in the model: save them together")
            name = names[id(p)]
            for key, value in optimizer.state.get(p, {}).items():
                logical = f"optim/{name}/{key}"
                if isinstance(value, torch.Tensor) and value.shape == p.shape and key != "step":
                    writer.add(logical, tuple(p.shape), value.dtype, value, kind="elementwise")
                elif isinstance(value, torch.Tensor):
                    writer.add(logical, tuple(value.shape), value.dtype, value, kind="whole")
                else:
                    values[logical] = value


def _optimizer_meta(optimizer: Any, zopt: Any) -> Optional[dict[str, Any]]:
    if optimizer is None:
        return None
    inner = zopt.optimizer if zopt is not None else optimizer
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    return {"class": type(inner).__name__, "param_groups": groups, "values": {}}


# ---------------------------------------------------------------------------- load
def load(
    path: str,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    *,
    comm: Optional[Communicator] = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Restore `model` (and `optimizer`) from the sharded checkpoint in `path`, whatever layout wrote it.

    Each rank reads only the parts its current layout needs. Returns the
    `extra` dict given to `save`. With `strict`, a parameter or buffer that
    is in the model but not in the checkpoint (or the reverse), or has
    another shape, is a CheckpointError listing every difference.
    """
    reader = ShardReader(path)
    try:
        zmodel, zopt = _zero_parts(model, optimizer)
        module = zmodel.module if zmodel is not None else unwrap(model)
        _check_names(path, reader, module, zmodel, strict)
        if zmodel is not None:
            zmodel.load_master(lambda name, a, b: reader.read_flat(f"model/{name}", a, b))
            sharded = set(zmodel.master_dtypes)
            _load_replicated(reader, module, skip=sharded)
        else:
            _load_replicated(reader, module, skip=set())
        if optimizer is not None:
            meta = reader.metadata.get("optimizer")
            if meta is None:
                raise CheckpointError(f"sharded checkpoint {path} holds no optimizer state, but an optimizer was given")
            inner = zopt.optimizer if zopt is not None else optimizer
            if meta["class"] != type(inner).__name__:
                raise CheckpointError(
                    f"sharded checkpoint {path} holds {meta['class']} state; the optimizer here is "
                    f"{type(inner).__name__}: build the same optimizer class, or load the model alone"
                )
            if zopt is not None:
                _load_zero_optimizer(reader, zopt, meta)
            else:
                _load_plain_optimizer(reader, module, optimizer, meta)
            if len(meta["param_groups"]) == len(inner.param_groups):
                for group, saved in zip(inner.param_groups, meta["param_groups"]):
                    group.update(saved)
            else:
                log.warning(
                    "checkpoint %s has %d param groups, this optimizer %d: hyperparameters not restored",
                    path,
                    len(meta["param_groups"]),
                    len(inner.param_groups),
                )
        return dict(reader.metadata.get("extra") or {})
    finally:
        reader.close()


def _check_names(path: str, reader: ShardReader, module: nn.Module, zmodel: Any, strict: bool) -> None:
    saved = {n[len("model/") :]: tuple(reader.info(n)["shape"]) for n in reader.names if n.startswith("model/")}
    current: dict[str, tuple[int, ...]] = {n: tuple(t.shape) for n, t in module.state_dict().items()}
    if zmodel is not None:  # stage 3 views have no storage: take the shapes from the layout
        current.update({s.name: tuple(s.shape) for b in zmodel.shards for s in b.unit.slots})
    problems = [
        f"{n} has shape {saved[n]} in the checkpoint but {shape} in the model"
        for n, shape in current.items()
        if n in saved and saved[n] != shape
    ]
    if strict:
        problems += [f"{n} is in the model but not in the checkpoint" for n in current if n not in saved]
        problems += [f"{n} is in the checkpoint but not in the model" for n in saved if n not in current]
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise CheckpointError(f"sharded checkpoint {path} does not fit this model: {shown}")


def _load_replicated(reader: ShardReader, module: nn.Module, skip: set[str]) -> None:
    with torch.no_grad():
        for name, t in module.state_dict(keep_vars=True).items():
            if name in skip or f"model/{name}" not in reader.metadata["tensors"]:
                continue
            t.copy_(reader.read_full(f"model/{name}").to(dtype=t.dtype).reshape(t.shape))


def _load_zero_optimizer(reader: ShardReader, zopt: Any, meta: dict[str, Any]) -> None:
    tensors = reader.metadata["tensors"]
    for buffers in zopt.model.shards:
        for piece, param in zip(buffers.pieces, buffers.piece_params):
            prefix = f"optim/{piece.name}/"
            state: dict[str, Any] = {}
            for logical, entry in tensors.items():
                if not logical.startswith(prefix):
                    continue
                key = logical[len(prefix) :]
                if entry["kind"] == "elementwise":
                    state[key] = reader.read_flat(logical, piece.start, piece.stop).to(param.device, param.dtype)
                else:
                    state[key] = reader.read_full(logical)
            for logical, value in meta["values"].items():
                if logical.startswith(prefix):
                    state[logical[len(prefix) :]] = value
            if state:
                zopt.optimizer.state[param] = state


def _load_plain_optimizer(reader: ShardReader, module: nn.Module, optimizer: Any, meta: dict[str, Any]) -> None:
    names = {id(p): n for n, p in module.named_parameters()}
    tensors = reader.metadata["tensors"]
    for group in optimizer.param_groups:
        for p in group["params"]:
            prefix = f"optim/{names[id(p)]}/"
            state: dict[str, Any] = {}
            for logical, entry in tensors.items():
                if logical.startswith(prefix):
                    value = reader.read_full(logical)
                    if entry["kind"] == "elementwise":
                        value = value.to(p.device, p.dtype).reshape(p.shape)
                    state[logical[len(prefix) :]] = value
            for logical, value in meta["values"].items():
                if logical.startswith(prefix):
                    state[logical[len(prefix) :]] = value
            if state:
                optimizer.state[p] = state


# ---------------------------------------------------------------------------- export
def export(path: str, out: str, *, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
    """Consolidate the model of the sharded checkpoint `path` into one file `out` (a plain `state_dict`, written
    atomically) for inference: `model.load_state_dict(torch.load(out, weights_only=True))`. One process; it
    holds the whole model. `dtype` casts floating-point tensors (for example torch.bfloat16). Returns the dict."""
    reader = ShardReader(path)
    try:
        state: dict[str, torch.Tensor] = {}
        for name in reader.names:
            if name.startswith("model/"):
                t = reader.read_full(name)
                state[name[len("model/") :]] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    finally:
        reader.close()
    if not state:
        raise CheckpointError(f"sharded checkpoint {path} holds no model tensors")
    _write_atomically(out, state)
    return state
