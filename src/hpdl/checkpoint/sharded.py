"""`save` / `load` of sharded checkpoints for ZeRO, DataParallel and plain models, and a single-file `export`.

`save` is collective over the model's communicator: each rank writes the
chunks it holds (a `ShardedState` such as ZeRO's model writes its pieces of
every parameter, its `ShardedOptimizer` those of the optimizer state;
replicated models: rank 0 writes everything), then rank 0 writes the
metadata (`hpdl.checkpoint.format`). The format knows no strategy: a
strategy that splits parameters implements the two protocols below. `load` asks, for the layout it is given
now, for exactly the parts each rank needs (`ShardReader`), whatever layout
and rank count wrote them: ZeRO stage 3 on 4 ranks loads into stage 1 on 2,
into DataParallel, or into one plain process, with no conversion step.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from typing import Any, Optional, Protocol, Sequence, cast

import torch
from torch import nn

from hpdl.checkpoint.errors import CheckpointError
from hpdl.checkpoint.files import unwrap, write_atomically
from hpdl.checkpoint.format import METADATA, read_metadata, shard_name, write_metadata, write_shard
from hpdl.checkpoint.reader import ShardReader
from hpdl.comm.base import Communicator

__all__ = ["save", "load", "export", "ShardWriter", "new_writer", "commit", "ShardedState", "ShardedOptimizer"]

log = logging.getLogger(__name__)


class ShardedState(Protocol):
    """A model whose parameters are split over ranks in flat ranges (ZeRO's `ZeroModel`): it writes and reads its
    own chunks; everything else of `module` (buffers, frozen parameters) is replicated and saved by rank 0."""

    @property
    def module(self) -> nn.Module:
        """The plain module (its state_dict names are the checkpoint's names)."""
        ...

    def shard_layout(self) -> dict[str, Any]:
        """How the writer was laid out, for the metadata ({"strategy": ..., ...})."""
        ...

    def shard_shapes(self) -> dict[str, tuple[int, ...]]:
        """Full shape of every parameter this layout splits (the others are replicated)."""
        ...

    def write_shards(self, writer: ShardWriter) -> None:
        """Add this rank's chunks of the split parameters to `writer` (collective caller: every rank)."""
        ...

    def read_shards(self, reader: ShardReader) -> None:
        """Load this rank's part of the split parameters, whatever layout wrote them."""
        ...


class ShardedOptimizer(Protocol):
    """The optimizer of a `ShardedState` (ZeRO's `ZeroOptimizer`): it holds the state of this rank's pieces."""

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer (its class and param_groups are recorded)."""
        ...

    def write_shards(self, writer: ShardWriter) -> None:
        """Add this rank's pieces of the optimizer state to `writer` (plain values into `writer.values`)."""
        ...

    def read_shards(self, reader: ShardReader, values: dict[str, Any]) -> None:
        """Load this rank's pieces of the optimizer state; `values`: the saved plain values by logical name."""
        ...


def _sharded_parts(model: nn.Module, optimizer: Any) -> tuple[Optional[ShardedState], Optional[ShardedOptimizer]]:
    state = cast(ShardedState, model) if _provides(model, ShardedState) else None
    opt = cast(ShardedOptimizer, optimizer) if _provides(optimizer, ShardedOptimizer) else None
    if opt is not None and state is None:
        raise TypeError(
            f"a {type(optimizer).__name__} is saved and loaded with the model it was built with "
            "(for a ZeroOptimizer: the ZeroModel that zero() returned with it)"
        )
    return state, opt


def _provides(obj: Any, protocol: type) -> bool:
    """Whether `obj` has every member of `protocol`, looked up as code does (getattr). isinstance on a runtime-checkable
    Protocol looks them up statically from Python 3.12 and misses a submodule that nn.Module keeps in `_modules`
    (ZeroModel's `module`): every ZeRO checkpoint failed there."""
    return all(hasattr(obj, name) for name in vars(protocol) if not name.startswith("_"))


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
    zmodel, zopt = _sharded_parts(model, optimizer)
    if zmodel is not None:
        _collect_sharded(writer, zmodel, zopt)
        layout: dict[str, Any] = zmodel.shard_layout()
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
        return set(read_metadata(path)["files"])
    except CheckpointError:
        return set()


def _collect_sharded(writer: ShardWriter, zmodel: ShardedState, zopt: Optional[ShardedOptimizer]) -> None:
    zmodel.write_shards(writer)
    if writer.rank == 0:  # replicated: buffers and frozen parameters
        sharded = set(zmodel.shard_shapes())
        for name, t in zmodel.module.state_dict().items():
            if name not in sharded:
                writer.add(f"model/{name}", tuple(t.shape), t.dtype, t, kind="replicated")
    if zopt is not None:
        zopt.write_shards(writer)


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


def _optimizer_meta(optimizer: Any, zopt: Optional[ShardedOptimizer]) -> Optional[dict[str, Any]]:
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
        zmodel, zopt = _sharded_parts(model, optimizer)
        module = zmodel.module if zmodel is not None else unwrap(model)
        _check_names(path, reader, module, zmodel, strict)
        if zmodel is not None:
            zmodel.read_shards(reader)
            _load_replicated(reader, module, skip=set(zmodel.shard_shapes()))
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
                zopt.read_shards(reader, meta["values"])
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


def _check_names(
    path: str, reader: ShardReader, module: nn.Module, zmodel: Optional[ShardedState], strict: bool
) -> None:
    saved = {n[len("model/") :]: tuple(reader.info(n)["shape"]) for n in reader.names if n.startswith("model/")}
    current: dict[str, tuple[int, ...]] = {n: tuple(t.shape) for n, t in module.state_dict().items()}
    if zmodel is not None:  # split parameters may have no storage here (ZeRO-3 views): take the layout's shapes
        current.update(zmodel.shard_shapes())
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
    write_atomically(out, state)
    return state
