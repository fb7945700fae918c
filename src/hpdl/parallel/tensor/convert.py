"""`parallelize`: turn a plain model's layers into tensor-parallel ones by name pattern, keeping their values.

    parallelize(model, mesh, {"*.attn.qkv": "qkv", "*.attn.out": "row", "*.mlp.fc": "column", "*.mlp.proj": "row"})

The user's model stays a plain `nn.Module` (torchtitan's
`parallelize_module`): each module whose name matches a pattern (fnmatch,
first match wins) is replaced in its parent by the tensor-parallel layer of
that style, loaded with this rank's slice of the module's existing weights.
tp rank 0's weights are broadcast first, so ranks that initialised
differently agree. Styles: see `hpdl.parallel.tensor.styles.TP_STYLES`.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Mapping

from torch import nn

from hpdl.comm.base import Communicator
from hpdl.parallel.data.data_parallel import broadcast_tensors
from hpdl.parallel.tensor.conv import ChannelParallelConv, FilterParallelConv
from hpdl.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from hpdl.parallel.tensor.styles import TP_STYLES, split_problem

__all__ = ["parallelize", "tp_comm_of"]


def tp_comm_of(mesh_or_comm: Any) -> Communicator:
    """The tensor-parallel communicator of a `Mesh` (its `tp`), or the communicator itself."""
    comm = getattr(mesh_or_comm, "tp", mesh_or_comm)
    if not isinstance(comm, Communicator):
        raise TypeError(f"expected a Mesh or a Communicator, got {type(mesh_or_comm).__name__}")
    return comm


def parallelize(model: nn.Module, mesh_or_comm: Any, plan: Any = None) -> nn.Module:
    """Convert `model`'s layers in place by pattern -> style and return it.

    `plan`: a mapping of fnmatch patterns on module names (as in
    `model.named_modules()`) to styles, a `Plan` (its `tp_plan`), or None
    for the model's own `tp_plan` attribute. Every pattern must match at
    least one module. With one tp rank the model is returned unchanged.
    Collective over the tp ranks (a broadcast of tp rank 0's parameters).
    """
    comm = tp_comm_of(mesh_or_comm)
    patterns = _patterns(model, plan)
    modules = dict((name, module) for name, module in model.named_modules() if name)
    chosen: dict[str, tuple[str, nn.Module]] = {}
    for pattern, style in patterns.items():
        matched = [name for name in modules if fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            raise ValueError(f"parallelize: pattern {pattern!r} ({style}) matches no module of {type(model).__name__}")
        for name in matched:
            if name not in chosen:
                problem = split_problem(modules[name], style, comm.size)
                if problem:
                    raise ValueError(f"parallelize: cannot split {name} as {style!r} over {comm.size} ranks: {problem}")
                chosen[name] = (style, modules[name])
    _check_not_tied(model, chosen)
    if comm.size == 1:
        return model
    broadcast_tensors(comm, [*model.parameters(), *model.buffers()], root=0)
    for name, (style, module) in chosen.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, convert(module, style, comm, name))
    return model


def _check_not_tied(model: nn.Module, chosen: dict[str, tuple[str, nn.Module]]) -> None:
    """A parameter shared with another module (tied embedding and head) cannot be split in one place only."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    for name, (style, module) in chosen.items():
        for p in module.parameters():
            if len(owners.get(id(p), [])) > 1:
                raise ValueError(
                    f"parallelize: {name} ({style}) shares a parameter with {', '.join(owners[id(p)])} (tied "
                    "weights); untie them (give each module its own copy) before splitting"
                )


def convert(module: nn.Module, style: str, comm: Communicator, name: str = "") -> nn.Module:
    """The tensor-parallel replacement of one module (its values sliced for this rank)."""
    where = f"parallelize: {name or type(module).__name__}"
    new = _convert(module, style, comm, where)
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    for n, p in new.named_parameters():
        p.requires_grad_(n not in frozen)
    return new.train(module.training)


def _convert(module: nn.Module, style: str, comm: Communicator, where: str) -> nn.Module:
    if style == "vocab":
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"{where}: style 'vocab' needs an nn.Embedding, found {type(module).__name__}")
        return VocabParallelEmbedding.from_embedding(module, comm)
    if style not in TP_STYLES:
        raise ValueError(f"{where}: unknown style {style!r}; styles: {sorted(TP_STYLES)}")
    if style in ("filter", "filter_gather", "channel"):
        if style == "channel":
            return ChannelParallelConv(module, comm)  # type: ignore[arg-type]
        return FilterParallelConv(module, comm, gather_output=style == "filter_gather")  # type: ignore[arg-type]
    if not isinstance(module, nn.Linear):
        raise TypeError(f"{where}: style {style!r} needs an nn.Linear, found {type(module).__name__}")
    if style == "row":
        return RowParallelLinear.from_linear(module, comm)
    if style == "qkv":
        return ColumnParallelLinear.from_linear(module, comm, parts=3)
    return ColumnParallelLinear.from_linear(module, comm, gather_output=style == "column_gather")


def _patterns(model: nn.Module, plan: Any) -> dict[str, str]:
    if callable(getattr(plan, "tp_plan_for", None)):  # an hpdl.parallel.Plan (defined above this package)
        patterns = dict(plan.tp_plan_for(model))
    elif plan is None:
        own = getattr(model, "tp_plan", None)
        patterns = dict(own) if isinstance(own, Mapping) else {}
    elif isinstance(plan, Mapping):
        patterns = dict(plan)
    else:
        raise TypeError(f"parallelize: plan must be a mapping pattern -> style, a Plan or None: {type(plan).__name__}")
    if not patterns:
        raise ValueError(
            f"parallelize: no layers to split: pass a plan such as {{'*.fc': 'column', '*.proj': 'row'}} "
            f"or give {type(model).__name__} a tp_plan attribute"
        )
    for pattern, style in patterns.items():
        if style not in TP_STYLES:
            raise ValueError(f"parallelize: {pattern!r}: unknown style {style!r}; styles: {sorted(TP_STYLES)}")
    return patterns
