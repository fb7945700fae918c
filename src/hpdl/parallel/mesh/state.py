"""The logical (full-size, plain-model-named) state of a model built on a `Mesh`, and loading it on any mesh.

A model built by `hpdl.parallel.build` is cut three ways: tensor-parallel
slices (`TPShard`), pipeline stages (each rank holds some layers, renamed
"0", "1", ... inside its stage) and ZeRO shards (flat ranges of each
parameter's optimizer state over the dp ranks). `full_state` undoes all
three: every parameter, buffer and optimizer-state tensor under the plain
model's name at full size, on every rank. `load_state` cuts such a state
for whatever mesh and plan the model was built with now. Together they
reshard a state from any mesh to any other in memory.

`save` / `load` go through files in `hpdl.checkpoint`'s sharded format:
each writing rank stores only its stage's tensors (tp slices as N-d boxes),
and each loading rank reads only the tensors of its own stage.
"""

from __future__ import annotations

import os
import secrets
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from hpdl.checkpoint.errors import CheckpointError
from hpdl.checkpoint.format import METADATA, read_metadata, shard_name, write_metadata, write_shard
from hpdl.checkpoint.reader import ShardReader
from hpdl.comm.base import Communicator
from hpdl.parallel.branch.module import branch_parameters
from hpdl.parallel.data import DataParallel
from hpdl.parallel.spatial import SpatialParallel
from hpdl.parallel.tensor import TPShard, tp_shards
from hpdl.parallel.zero_redundancy import ZeroModel

__all__ = ["full_state", "load_state", "save", "load", "view_of", "LAYER_NAMES"]

LAYER_NAMES: weakref.WeakKeyDictionary[Any, list[str]] = weakref.WeakKeyDictionary()
"""Pipeline built by `build` -> the names of the model's layers, so that stage parameters keep their model names."""


@dataclass
class _View:
    """What this rank holds: the plain module, its wrapper, and how its names map to the model's."""

    plain: nn.Module
    wrapper: Optional[nn.Module]
    logical: Callable[[str], str]
    local: Callable[[str], Optional[str]]


def view_of(model: Any) -> _View:
    """What `model` (a plain module, its DataParallel or ZeRO wrapper, or a `Pipeline`) holds on this rank."""
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.Sequential) and hasattr(model, "first_layer"):  # a Pipeline
        names = LAYER_NAMES.get(model) or [str(i) for i in range(model.first_layer + len(layers))]
        first, count = model.first_layer, len(layers)
        own = {names[first + i]: str(i) for i in range(count)}

        def logical(name: str) -> str:
            index, _, rest = name.partition(".")
            return f"{names[first + int(index)]}.{rest}" if rest else names[first + int(index)]

        def local(name: str) -> Optional[str]:
            head, _, rest = name.partition(".")
            if head not in own:
                return None
            return f"{own[head]}.{rest}" if rest else own[head]

        wrapper = model.module if model.module is not layers else None
        return _View(layers, wrapper, logical, local)
    if isinstance(model, (DataParallel, ZeroModel, SpatialParallel)):  # spatial: weights whole on every rank
        return _View(model.module, model, _same, _same)
    if isinstance(model, nn.Module):
        return _View(model, None, _same, _same)
    raise TypeError(f"expected a model or pipeline returned by hpdl.parallel.build, got {type(model).__name__}")


def _refuse_branches(view: _View, what: str) -> None:
    """Mesh checkpoints take every tensor from tp rank 0 or from its tp slices; a `BranchParallel` block's
    branches live on one tp rank each, which neither covers: an error, not a checkpoint missing branches."""
    if branch_parameters(view.plain):
        raise NotImplementedError(
            f"{what}: the model has BranchParallel blocks (a plan's 'branch' style), whose branches each live on "
            "one tp rank; mesh checkpoints do not gather them yet. Save with a plan of tp=1, or each rank's own "
            "model.state_dict()"
        )


def _same(name: str) -> str:
    return name


def _is_zero(wrapper: Optional[nn.Module]) -> bool:
    return isinstance(wrapper, ZeroModel)


def _unsharded(view: _View) -> dict[str, torch.Tensor]:
    """The plain module's state entries that are ordinary tensors: all of them, except ZeRO's trainable
    parameters (whose values live in its master shards; at stage 3 their storage is freed between uses)."""
    state = view.plain.state_dict(keep_vars=True)
    if _is_zero(view.wrapper):
        trainable = set(getattr(view.wrapper, "master_dtypes", {}))
        return {k: v for k, v in state.items() if k not in trainable}
    return state


# ---------------------------------------------------------------------- gather
@torch.no_grad()
def full_state(model: Any, optimizer: Optional[torch.optim.Optimizer], mesh: Any) -> dict[str, Any]:
    """{"model": name -> full tensor, "optimizer": name -> {key: full tensor or value}, "param_groups": [...]}.

    Names are the plain model's. Collective over the whole mesh; the result is the same on every rank.
    """
    view = view_of(model)
    _refuse_branches(view, "full_state")
    shards = tp_shards(view.plain)
    local = {k: v.detach().clone() for k, v in _unsharded(view).items()}
    if _is_zero(view.wrapper):  # the fp32 masters (stage 3: the parameters exist only as shards)
        local.update(view.wrapper.full_parameters())  # type: ignore[union-attr,operator]
    params = dict(view.plain.named_parameters())
    state: dict[str, Any] = {"model": _gather_tp(local, shards, mesh.tp)}
    opt_local: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    if optimizer is not None:
        if _is_zero(view.wrapper):
            opt_local = _zero_state(optimizer, params, mesh.dp)
        else:
            by_param = {id(p): name for name, p in params.items()}
            for p, st in optimizer.state.items():
                name = by_param.get(id(p))
                if name is not None:
                    opt_local[name] = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    opt_full: dict[str, dict[str, Any]] = {}
    for name in params:  # the same order on every tp rank: the gathers below are collective
        entry = opt_local.get(name, {})
        shard = shards.get(name)
        keys = sorted(entry)
        opt_full[name] = {}
        for key in keys:
            value = entry[key]
            if shard is not None and torch.is_tensor(value) and tuple(value.shape) == shard.local_shape:
                value = _gather_one(value, shard, mesh.tp)
            opt_full[name][key] = value
    state["optimizer"] = {k: v for k, v in opt_full.items() if v}
    state = {
        "model": {view.logical(k): v for k, v in state["model"].items()},
        "optimizer": {view.logical(k): v for k, v in state["optimizer"].items()},
    }
    if mesh.pp.size > 1:  # every stage holds some layers: merge them
        parts = mesh.pp.allgather_object(state)
        state = {"model": {}, "optimizer": {}}
        for part in parts:
            state["model"].update(part["model"])
            state["optimizer"].update(part["optimizer"])
    state["param_groups"] = groups
    return state


def _gather_one(value: torch.Tensor, shard: TPShard, comm: Communicator) -> torch.Tensor:
    if comm.size == 1:
        return value.clone()
    gathered = comm.allgather(value.contiguous().reshape(1, -1), sizes=[1] * comm.size)
    return shard.assemble([row.view(shard.local_shape) for row in gathered])


def _gather_tp(values: dict[str, torch.Tensor], shards: dict[str, TPShard], comm: Communicator) -> dict:
    return {k: (_gather_one(v, shards[k], comm) if k in shards else v) for k, v in values.items()}


def _zero_state(optimizer: Any, params: dict[str, nn.Parameter], dp: Communicator) -> dict[str, dict[str, Any]]:
    """The optimizer state of every (tp-local) parameter, assembled from the dp ranks' ZeRO pieces."""
    mine = [
        (name, start, stop, {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()})
        for name, start, stop, st in optimizer.piece_states()
    ]
    pieces = dp.allgather_object(mine) if dp.size > 1 else [mine]
    out: dict[str, dict[str, Any]] = {}
    for rank_pieces in pieces:
        for name, start, stop, st in rank_pieces:
            p = params[name]
            entry = out.setdefault(name, {})
            for key, value in st.items():
                if torch.is_tensor(value) and value.numel() == stop - start and value.dim() == 1 and stop - start > 0:
                    flat = entry.get(key)
                    if flat is None or not torch.is_tensor(flat) or flat.numel() != p.numel():
                        flat = entry[key] = torch.zeros(p.numel(), dtype=value.dtype)
                    flat[start:stop] = value
                else:
                    entry.setdefault(key, value)
    for name, entry in out.items():
        for key, value in entry.items():
            if torch.is_tensor(value) and value.numel() == params[name].numel() and value.dim() == 1:
                entry[key] = value.view(params[name].shape)
    return out


# ---------------------------------------------------------------------- load
@torch.no_grad()
def load_state(model: Any, optimizer: Optional[torch.optim.Optimizer], state: dict[str, Any]) -> None:
    """Load a `full_state` result into a model (and optimizer) built by `build` on any mesh; no communication
    except ZeRO's republishing of parameters (collective over its dp group)."""
    view = view_of(model)
    _refuse_branches(view, "load_state")
    shards = tp_shards(view.plain)
    full_model = state["model"]
    cut: dict[str, torch.Tensor] = {}
    for name in view.plain.state_dict():
        logical = view.logical(name)
        if logical not in full_model:
            raise KeyError(f"load_state: the checkpoint has no {logical!r} (is it from another model?)")
        value = full_model[logical]
        cut[name] = shards[name].take(value) if name in shards else value
    params = dict(view.plain.named_parameters())
    zero = _is_zero(view.wrapper)
    if zero:  # the masters, then ZeRO publishes the parameters
        view.wrapper.load_master(lambda n, a, b: cut[n].reshape(-1)[a:b])  # type: ignore[union-attr,operator]
    for name, target in _unsharded(view).items():
        target.copy_(cut[name].to(target.dtype))
    if optimizer is None:
        return
    full_opt = state.get("optimizer", {})
    local_opt: dict[str, dict[str, Any]] = {}
    for name in params:
        entry = full_opt.get(view.logical(name))
        if not entry:
            continue
        shard = shards.get(name)
        local_opt[name] = {
            k: (
                (shard.take(v) if shard is not None and tuple(v.shape) == shard.global_shape else v.clone())
                if torch.is_tensor(v)
                else v
            )
            for k, v in entry.items()
        }
    if zero:
        for name, start, stop, _ in list(optimizer.piece_states()):  # type: ignore[attr-defined]
            entry = local_opt.get(name)
            if entry is None:
                continue
            piece = {
                k: (
                    v.reshape(-1)[start:stop].clone()
                    if torch.is_tensor(v) and v.numel() == params[name].numel() and v.dim() > 0
                    else (v.clone() if torch.is_tensor(v) else v)
                )
                for k, v in entry.items()
            }
            optimizer.set_piece_state(name, start, piece)  # type: ignore[attr-defined]
    else:
        for name, entry in local_opt.items():
            optimizer.state[params[name]] = entry
    for group, saved in zip(optimizer.param_groups, state.get("param_groups", [])):
        group.update({k: v for k, v in saved.items() if k != "params"})


# ---------------------------------------------------------------------- sharded files (hpdl.checkpoint's format)
def _local_tensors(view: _View, optimizer: Any, mesh: Any) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """This rank's parameters and buffers at tp-local size, and its optimizer state (ZeRO pieces joined over dp)."""
    model_local = {k: v.detach() for k, v in _unsharded(view).items()}
    opt_local: dict[str, dict[str, Any]] = {}
    params = dict(view.plain.named_parameters())
    if _is_zero(view.wrapper):
        model_local.update(view.wrapper.full_parameters())  # type: ignore[union-attr,operator]
        if optimizer is not None:
            opt_local = _zero_state(optimizer, params, mesh.dp)
    elif optimizer is not None:
        by_param = {id(p): name for name, p in params.items()}
        for p, st in optimizer.state.items():
            if id(p) in by_param:
                opt_local[by_param[id(p)]] = dict(st)
    return model_local, opt_local


def save(path: str, model: Any, optimizer: Optional[torch.optim.Optimizer], mesh: Any, **extra: Any) -> None:
    """Write a sharded checkpoint of a model built on `mesh` into the folder `path` (collective over the mesh).

    The format is `hpdl.checkpoint`'s: per logical tensor (the plain
    model's names) its global shape and chunks, tensor-parallel slices as
    N-d boxes. Rank dp=0 (and sp=0) of each (stage, tp slice) writes what its stage
    holds, so every tensor is written once. It loads with `load` on any
    mesh, and with `hpdl.checkpoint.load` into a plain, DataParallel or
    ZeRO model.
    """
    view = view_of(model)
    _refuse_branches(view, "save")
    shards = tp_shards(view.plain)
    params = dict(view.plain.named_parameters())
    model_local, opt_local = _local_tensors(view, optimizer, mesh)
    world = mesh.world
    save_id = world.broadcast_object(secrets.token_hex(4) if world.rank == 0 else "")
    os.makedirs(path, exist_ok=True)
    file = shard_name(world.rank, world.size, save_id)
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict[str, Any]] = {}
    values: dict[str, Any] = {}

    def add(logical: str, t: torch.Tensor, shard: Optional[TPShard], kind: str) -> None:
        if shard is None and mesh.tp.rank != 0:
            return  # replicated over tp: tp rank 0 writes it
        full_shape = shard.global_shape if shard is not None else tuple(t.shape)
        entry = entries.setdefault(
            logical, {"shape": full_shape, "dtype": str(t.dtype).replace("torch.", ""), "chunks": [], "kind": kind}
        )
        if shard is None:
            key = f"{logical}@0"
            tensors[key] = t.detach().reshape(-1).to("cpu").clone()
            entry["chunks"].append({"file": file, "key": key, "flat": (0, t.numel())})
            return
        for (lo, _), (offsets, sizes) in zip(shard.pieces(), shard.boxes()):
            key = f"{logical}@{offsets[shard.dim]}"
            part = t.detach().narrow(shard.dim, lo.start, lo.stop - lo.start)
            tensors[key] = part.reshape(-1).to("cpu").clone()
            box = tuple((o, o + n) for o, n in zip(offsets, sizes))
            entry["chunks"].append({"file": file, "key": key, "box": box})

    if mesh.dp.rank == 0 and mesh.sp.rank == 0:  # a spatial group's ranks hold the same whole weights
        for name, t in model_local.items():
            add(f"model/{view.logical(name)}", t, shards.get(name), "param" if name in params else "replicated")
        for name, st in opt_local.items():
            for key, value in st.items():
                logical = f"optim/{view.logical(name)}/{key}"
                if torch.is_tensor(value) and key != "step" and tuple(value.shape) == tuple(params[name].shape):
                    add(logical, value, shards.get(name), "elementwise")
                elif torch.is_tensor(value):
                    add(logical, value, None, "whole")
                elif mesh.tp.rank == 0:
                    values[logical] = value
    file_entry = write_shard(path, file, tensors)
    file_entry["rank"] = world.rank
    gathered = world.allgather_object((file, file_entry, entries, values))
    if world.rank == 0:
        merged: dict[str, dict[str, Any]] = {}
        files: dict[str, Any] = {}
        all_values: dict[str, Any] = {}
        for f, f_entry, f_entries, f_values in gathered:
            files[f] = f_entry
            all_values.update(f_values)
            for name, e in f_entries.items():
                target = merged.setdefault(name, {k: v for k, v in e.items() if k != "chunks"} | {"chunks": []})
                target["chunks"].extend(e["chunks"])
        old: set[str] = set()
        if os.path.exists(os.path.join(path, METADATA)):
            try:
                old = set(read_metadata(path)["files"])
            except Exception:  # an unreadable old checkpoint is replaced, not an error
                old = set()
        inner = getattr(optimizer, "optimizer", optimizer)
        groups = [] if inner is None else [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
        layout = {"strategy": "mesh", **dict(mesh.shape), "placement": list(mesh.placement)}
        if _is_zero(view.wrapper):
            layout["stage"] = view.wrapper.stage  # type: ignore[union-attr]
        write_metadata(
            path,
            {
                "world_size": world.size,
                "layout": layout,
                "files": files,
                "tensors": merged,
                "optimizer": None
                if inner is None
                else {"class": type(inner).__name__, "param_groups": groups, "values": all_values},
                "extra": dict(extra),
            },
        )
        for name in old - set(files):
            try:
                os.remove(os.path.join(path, name))
            except OSError:
                pass
    world.barrier()


def load(path: str, model: Any, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, Any]:
    """Load a sharded checkpoint (from `save` on any mesh, or `hpdl.checkpoint.save`) into a model built on
    any mesh; each rank reads the tensors of its stage and cuts its tp slice. Returns the saved `extra`."""
    reader = ShardReader(path)
    try:
        view = view_of(model)
        _refuse_branches(view, "load")
        names = set(reader.names)
        wanted = [view.logical(n) for n in view.plain.state_dict()]
        missing = [n for n in wanted if f"model/{n}" not in names]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise CheckpointError(f"checkpoint {path} has no {', '.join(missing[:5])}{more}: is it from another model?")
        state: dict[str, Any] = {"model": {n: reader.read_full(f"model/{n}") for n in wanted}, "optimizer": {}}
        if optimizer is not None:
            meta = reader.metadata.get("optimizer")
            inner = getattr(optimizer, "optimizer", optimizer)
            if meta is None:
                raise CheckpointError(f"checkpoint {path} holds no optimizer state, but an optimizer was given")
            if meta["class"] != type(inner).__name__:
                raise CheckpointError(
                    f"checkpoint {path} holds {meta['class']} state; the optimizer here is {type(inner).__name__}"
                )
            for name, _ in view.plain.named_parameters():
                logical = view.logical(name)
                prefix = f"optim/{logical}/"
                entry = {n[len(prefix) :]: reader.read_full(n) for n in names if n.startswith(prefix)}
                entry.update({k[len(prefix) :]: v for k, v in meta["values"].items() if k.startswith(prefix)})
                if entry:
                    state["optimizer"][logical] = entry
            state["param_groups"] = meta["param_groups"]
        load_state(model, optimizer, state)
        return dict(reader.metadata.get("extra") or {})
    finally:
        reader.close()
