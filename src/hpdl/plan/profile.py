"""A model profile: per layer, parameters, forward FLOPs and activation bytes per sample.

The cost model needs nothing else about a model. A profile comes from a
named reference model's published shapes (`hpdl.plan.models`) or from
running the model's layers once (`measure`): FLOPs from
`torch.utils.flop_counter.FlopCounterMode` (per module), activation bytes
from the tensors autograd saves for backward (`saved_tensors_hooks`,
parameters excluded), output bytes from forward hooks. A model too big to
build in memory is built on the meta device, where shapes and FLOPs are
exact and nothing is allocated.

"Layer" means a pipeline unit: the children of an `nn.Sequential`, or the
top-level children of any other module with `nn.ModuleList`/`Sequential`
children expanded into their elements, in the order forward runs them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

__all__ = ["Layer", "ModelProfile", "measure", "measure_factory", "load_factory", "ProfileError"]


class ProfileError(ValueError):
    """A model could not be profiled; the message says what the planner needs."""


@dataclass(frozen=True)
class Layer:
    """One pipeline unit; every count is per sample (one sequence, one image) unless it says otherwise."""

    name: str
    params: int
    """Parameters this layer owns (tied weights counted once, at their first layer)."""
    flops: float
    """Forward FLOPs per sample (a multiply-add counts 2); backward costs 2x."""
    activation_bytes: float
    """Bytes saved for backward per sample, at the profile's dtype, with no tensor parallelism."""
    output_bytes: float
    """Bytes of the layer's output per sample: what a pipeline stage boundary sends, and what a recomputed
    layer keeps (its input is the previous layer's output)."""
    tp_params: int = 0
    """Of `params`, the ones tensor parallelism splits (Linear weights, vocabulary embedding)."""
    tp_flops: float = 0.0
    """Of `flops`, the ones tensor parallelism splits."""
    tp_activation_bytes: float = 0.0
    """Of `activation_bytes`, the ones tensor parallelism splits."""
    tp_allreduce_fwd: int = 0
    """Allreduces of `output_bytes` per micro-batch in forward under tensor parallelism (Megatron block: 2)."""
    tp_allreduce_bwd: int = 0
    """The same in backward (Megatron block: 2)."""
    tp_max: int = 0
    """Largest tensor-parallel degree this layer allows (attention heads); 0: no limit."""
    ops: int = 0
    """Operators dispatched in one forward (aten calls): the framework overhead that does not shrink with
    the batch; 0 when not counted (analytic profiles rely on the cluster's per-layer overhead)."""
    tensors: int = 0
    """Parameter tensors (the optimizer's per-tensor overhead)."""
    fwd_fixed_s: float = 0.0
    """Measured forward seconds that do not grow with the batch (this machine, one thread); 0: not timed."""
    fwd_per_sample_s: float = 0.0
    """Measured forward seconds per sample (this machine, one thread); 0: not timed."""
    tied_params: int = 0
    """Parameters this layer uses but another layer owns (a tied LM head); held again if on another stage."""
    tied_to: int = -1
    """Index of the owning layer of `tied_params`."""
    spatial: bool = False
    """`hpdl.parallel.spatial.SpatialParallel` runs this layer on slabs of each sample (split along the height):
    every leaf a convolution, pooling, batch norm or element-wise layer, and no global pool or Flatten before it.
    Its FLOPs and activations then divide by the spatial degree; the others run replicated."""
    halo_bytes: float = 0.0
    """Of a spatial layer, bytes per sample a slab sends its neighbour across one boundary in forward: the halo
    rows of its convolutions and pools (backward sends as many gradient bytes back)."""
    halo_messages: int = 0
    """Convolutions and pools of a spatial layer that exchange halos (messages per boundary and direction)."""
    tp_branches: int = 0
    """Of a unit that holds a `Branches` block spread over tp (the style "branch"), its branch count; 0: none."""
    tp_heads: int = 0
    """Attention heads that tp must divide, where the unit also holds a `Branches` block (elsewhere `tp_max`
    says it); 0: none."""
    tp_busiest: tuple[float, ...] = ()
    """Of a unit with `Branches` blocks, for tp = 1, 2, ...: the fraction of its tp-split FLOPs that the busiest
    tp rank runs (whole branches, placed by parameter count as a Plan places them); empty: 1 / tp."""
    tp_busiest_params: tuple[float, ...] = ()
    """The same for its tp-split parameters."""
    spatial_rows: int = 0
    """Of a spatial layer, the fewest rows along the split dimension of its input and output: each slab needs
    at least a row of each."""

    def tp_allows(self, tp: int) -> bool:
        """Whether degree `tp` can split this layer: whole branches need a branch per rank (3 ranks may hold 4
        branches: `tp_share` prices the busiest), attention heads must divide evenly."""
        if self.tp_branches:
            return tp <= self.tp_max and (not self.tp_heads or self.tp_heads % tp == 0)
        return not self.tp_max or self.tp_max % tp == 0

    def tp_share(self, tp: int) -> float:
        """The fraction of the tp-split FLOPs (and activations) one rank runs at degree `tp`: the busiest's."""
        return self.tp_busiest[tp - 1] if tp <= len(self.tp_busiest) else 1 / tp

    def tp_param_share(self, tp: int) -> float:
        """The fraction of the tp-split parameters the rank holding the most holds at degree `tp`."""
        return self.tp_busiest_params[tp - 1] if tp <= len(self.tp_busiest_params) else 1 / tp

    def scaled(self, factor: float) -> Layer:
        """The same layer with activation and output bytes times `factor` (another activation dtype)."""
        return replace(
            self,
            activation_bytes=self.activation_bytes * factor,
            output_bytes=self.output_bytes * factor,
            tp_activation_bytes=self.tp_activation_bytes * factor,
            halo_bytes=self.halo_bytes * factor,
        )


@dataclass(frozen=True)
class ModelProfile:
    """The layers of a model and the dtype its byte counts were taken at."""

    name: str
    layers: tuple[Layer, ...]
    act_dtype_bytes: int = 4
    """Bytes per activation element the byte counts assume (4 for fp32, 2 for bf16/fp16)."""
    sample: str = "sample"
    """What one sample is ("sequence of 1024 tokens", "224x224 image")."""
    source: str = ""
    """How the numbers were obtained (analytic formula or measured)."""
    backward_ratio: float = 2.0
    """Backward time over forward time: 2 by the FLOP count; measured when the layers were timed."""

    @property
    def timed(self) -> bool:
        """Whether per-layer times were measured (`measure(..., time_batches=...)`).

        A fixed part counts too: on a busy machine every layer's slope over the two batches can come out
        zero (the larger batch measured no slower), and the layers were timed all the same."""
        return any(layer.fwd_per_sample_s > 0 or layer.fwd_fixed_s > 0 for layer in self.layers)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ProfileError(f"model {self.name!r} has no layers to plan over")

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def flops(self) -> float:
        return sum(layer.flops for layer in self.layers)

    def at_dtype(self, dtype_bytes: int) -> ModelProfile:
        """The profile with activations counted at `dtype_bytes` per element."""
        if dtype_bytes == self.act_dtype_bytes:
            return self
        factor = dtype_bytes / self.act_dtype_bytes
        layers = tuple(layer.scaled(factor) for layer in self.layers)
        return replace(self, layers=layers, act_dtype_bytes=dtype_bytes)

    def spatial_limit(self) -> int:
        """Largest spatial degree every spatial layer allows (a row per slab); 0: no layer runs on slabs."""
        rows = [layer.spatial_rows for layer in self.layers if layer.spatial]
        return min(rows) if rows else 0

    @property
    def branched(self) -> bool:
        """Whether tensor parallelism spreads `Branches` blocks (which a plan does not combine with ZeRO)."""
        return any(layer.tp_branches for layer in self.layers)

    def tp_allows(self, tp: int) -> bool:
        """Whether every layer can be split over `tp` ranks (see `Layer.tp_allows`)."""
        return all(layer.tp_allows(tp) for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "params": self.params,
            "flops_per_sample": self.flops,
            "sample": self.sample,
            "source": self.source,
            "act_dtype_bytes": self.act_dtype_bytes,
            "layers": [layer.__dict__ for layer in self.layers],
        }


# --------------------------------------------------------------------------- measuring
def _units(model: Any) -> list[tuple[str, Any]]:
    import torch.nn as nn

    if isinstance(model, nn.Sequential):
        return list(model.named_children())
    units: list[tuple[str, Any]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.Sequential)):
            units += [(f"{name}.{sub}", grand) for sub, grand in child.named_children()]
        else:
            units.append((name, child))
    return units or [("model", model)]


def _nbytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


def _to(value: Any, device: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


def measure(
    model: Any,
    example_input: Callable[[int], Any],
    *,
    name: str = "model",
    batch: int = 2,
    sample: str = "sample",
    tp_plan: Optional[dict[str, str]] = None,
    time_batches: Optional[tuple[int, int]] = None,
    reps: int = 3,
) -> ModelProfile:
    """Profile `model` by running one forward pass on `example_input(batch)` (meta or real tensors).

    The model may live on the meta device; the input is moved to the
    model's device. Counts are divided by `batch` (per sample).
    `tp_plan` (name pattern -> style, as in `hpdl.parallel.Plan`; default:
    the model's own `tp_plan` attribute) says which layers tensor
    parallelism splits; without one the planner keeps tp = 1.
    `time_batches=(b1, b2)` also times every layer's forward (one torch
    thread, median of `reps`) at two batch sizes and fits fixed + per-sample
    seconds, and the whole backward over the whole forward: what the cost
    model uses for this machine instead of FLOPs / rate (`CostModel(measured=True)`).
    """
    import torch
    import torch.nn as nn
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    _FREE_OPS = {torch.ops.aten.detach.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}

    if not isinstance(model, nn.Module):
        raise ProfileError(f"measure() profiles an nn.Module, got {type(model).__name__}")
    from hpdl.parallel.branch.block import branch_plan, nested_in_branches

    if tp_plan is None:  # the model's own, else its Branches blocks (what hpdl.parallel.Plan does)
        own = getattr(model, "tp_plan", None)
        tp_plan = own if own is not None else branch_plan(model)
    tp_plan = dict(tp_plan)
    nested = nested_in_branches(model, tp_plan)
    if nested:
        raise ProfileError(
            f"model {name!r}: tp_plan splits {', '.join(nested[:3])} inside a 'branch' block (each tp rank holds "
            "other branches there); leave the branches whole"
        )
    config = getattr(model, "config", None)
    heads = getattr(config, "n_head", 0) if isinstance(getattr(config, "n_head", 0), int) else 0
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    inputs = _to(example_input(batch), device)
    units = _units(model)
    index = {id(module): i for i, (_, module) in enumerate(units)}
    order: list[int] = []
    current: list[int] = [0]
    outputs = [0] * len(units)
    saved = [0] * len(units)
    params = {id(p) for p in model.parameters()}
    seen: set[Any] = set()

    shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def pre(module: Any, args: Any) -> None:
        i = index[id(module)]
        if i not in order:
            order.append(i)
        current[0] = i
        if args and isinstance(args[0], torch.Tensor):
            shapes[i] = (tuple(args[0].shape), ())

    def post(module: Any, _args: Any, output: Any) -> None:
        i = index[id(module)]
        outputs[i] = _nbytes(output)
        if i in shapes and isinstance(output, torch.Tensor):
            shapes[i] = (shapes[i][0], tuple(output.shape))

    def pack(t: Any) -> Any:
        base = t._base if t._base is not None else t
        if id(t) in params or id(base) in params:
            return t
        key: Any = id(base) if t.device.type == "meta" else (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen:
            seen.add(key)
            saved[current[0]] += _nbytes(base if t.device.type != "meta" else t)
        return t

    ops = [0] * len(units)

    class OpCounter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func not in _FREE_OPS:
                ops[current[0]] += 1
            return func(*args, **(kwargs or {}))

    handles = [m.register_forward_pre_hook(pre) for _, m in units] + [m.register_forward_hook(post) for _, m in units]
    counter = FlopCounterMode(display=False)
    try:
        with counter, OpCounter(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
        del out
    finally:
        for handle in handles:
            handle.remove()
    counts = {key: float(sum(v.values())) for key, v in counter.get_flop_counts().items()}
    root = type(model).__name__
    total = counts.get("Global", 0.0)
    layers = []
    owned: set[int] = set()
    dtype_bytes = 4
    for i in order:
        unit_name, module = units[i]
        flops = counts.get(f"{root}.{unit_name}", 0.0)
        unit_params = [p for p in module.parameters() if id(p) not in owned]
        owned.update(id(p) for p in unit_params)
        # Tensor parallelism splits the modules the model's tp_plan names (hpdl.parallel.Plan's styles):
        # a row-parallel or vocabulary layer allreduces its output in forward, a column one its input
        # gradient in backward (Megatron). Without a tp_plan the layer is not split (tp_max = 1).
        # A "branch" block (Branches) spreads its branches, every parameter and FLOP of them, over the tp
        # ranks: one merge of its output in forward, one sum of its input gradient in backward (counted
        # as allreduces of the output: an allgather of a concat costs less), at most one rank per branch.
        split = _tp_modules(module, unit_name, tp_plan)
        split_ids = {id(m) for m, _ in split}
        tp_params = sum(
            p.numel() for m, style in split for p in m.parameters(recurse=style == "branch") if id(p) in params
        )
        branch_counts = [len(m.branches) for m, style in split if style == "branch"]
        sub_names = {id(m): sub for sub, m in module.named_modules()}
        prefix = f"{root}.{unit_name}"
        blocks = [
            (
                [counts.get(f"{prefix}{'.' if sub_names[id(m)] else ''}{sub_names[id(m)]}.branches.{i}", 0.0)
                 for i in range(len(m.branches))],
                [float(sum(p.numel() for p in b.parameters())) for b in m.branches],
            )
            for m, style in split
            if style == "branch"
        ]  # fmt: skip
        split_names = [sub for sub, m in module.named_modules() if id(m) in split_ids]
        # A head-split qkv projection splits its attention module's score and weighted-sum FLOPs too.
        qkv = {id(m) for m, style in split if style == "qkv"}
        split_names += [sub.rpartition(".")[0] for sub, m in module.named_modules() if id(m) in qkv and "." in sub]
        split_names = [n for n in split_names if not any(n.startswith(f"{o}.") for o in split_names if o != n)]
        tp_flops = sum(counts.get(f"{root}.{unit_name}.{sub}", 0.0) if sub else flops for sub in set(split_names))
        share = tp_flops / flops if flops else 0.0
        float_params = [p for p in unit_params if p.is_floating_point()]
        if float_params:
            dtype_bytes = float_params[0].element_size()
        layers.append(
            Layer(
                name=unit_name,
                params=sum(p.numel() for p in unit_params),
                flops=flops / batch,
                activation_bytes=saved[i] / batch,
                output_bytes=outputs[i] / batch,
                tp_params=min(tp_params, sum(p.numel() for p in unit_params)),
                tp_flops=tp_flops / batch,
                tp_activation_bytes=saved[i] * share / batch,
                tp_allreduce_fwd=sum(style in ("row", "vocab", "branch") for _, style in split),
                tp_allreduce_bwd=sum(style in ("column", "qkv", "column_gather", "branch") for _, style in split),
                tp_max=min(branch_counts + ([heads] if heads else [])) if branch_counts else (heads if tp_plan else 1),
                tp_branches=min(branch_counts, default=0),
                tp_heads=heads if branch_counts and tp_plan else 0,
                tp_busiest=_busiest(blocks, tp_flops, 0, min(branch_counts, default=0)),
                tp_busiest_params=_busiest(blocks, tp_params, 1, min(branch_counts, default=0)),
                ops=ops[i],
                tensors=len(unit_params),
            )
        )
    if not layers:
        raise ProfileError(f"model {name!r}: forward ran none of its layers {[n for n, _ in units]}")
    # FLOPs and saved tensors outside every unit (the root's own forward code) go to the last layer.
    rest = total - sum(layer.flops * batch for layer in layers)
    if rest > 0:
        layers[-1] = replace(layers[-1], flops=layers[-1].flops + rest / batch)
    loose = sum(p.numel() for p in model.parameters() if id(p) not in owned)
    if loose:
        layers[0] = replace(layers[0], params=layers[0].params + loose)
    layers = _with_spatial(layers, [units[i][1] for i in order], [shapes.get(i) for i in order], batch)
    where = "meta device" if device.type == "meta" else f"{device.type}, batch {batch}"
    ratio = 2.0
    if time_batches and device.type != "meta":
        timed, ratio = _time_layers(model, example_input, units, order, time_batches, reps)
        layers = [replace(layer, fwd_fixed_s=f, fwd_per_sample_s=p) for layer, (f, p) in zip(layers, timed)]
        where += f"; forward timed at batches {time_batches[0]} and {time_batches[1]}"
    return ModelProfile(
        name=name,
        layers=tuple(layers),
        act_dtype_bytes=dtype_bytes,
        sample=sample,
        source=f"measured: one forward pass ({where}); FlopCounterMode FLOPs, autograd saved tensors",
        backward_ratio=ratio,
    )


def _with_spatial(layers: list[Layer], modules: list[Any], shapes: list[Any], batch: int) -> list[Layer]:
    """Mark the layers SpatialParallel would run on slabs (split along dim 2) and count their halos.

    The layers up to the first one that is not entirely convolutions, pools, batch norms and element-wise
    leaves (or that holds a global pool or Flatten) are spatial; from there on the network is replicated, as
    `hpdl.parallel.spatial.convert` decides. The halo bytes come from `spatial_estimate` at 2 slabs, the same
    windows the layers use (a boundary's rows do not depend on how many slabs there are)."""
    from hpdl.parallel.spatial.convert import CONVS, ELEMENTWISE, NORMS, POOLS
    from hpdl.parallel.spatial.cost import spatial_estimate

    out = list(layers)
    for k, (layer, module, shape) in enumerate(zip(layers, modules, shapes)):
        leaves = [m for m in module.modules() if not list(m.children())]
        if shape is None or len(shape[0]) < 3 or len(shape[1]) < 3:
            break
        if not all(isinstance(m, CONVS + POOLS + NORMS + ELEMENTWISE) for m in leaves):
            break  # a global pool, Flatten, Linear, attention: replicated from here on
        rows = min(shape[0][2], shape[1][2])
        halo, messages = 0.0, 0
        if rows >= 2 and any(isinstance(m, CONVS + POOLS) for m in leaves):
            try:
                estimate = spatial_estimate(module, shape[0], parts=2)
            except ValueError:  # a layer whose windows cannot split (thinner than its halo): not spatial
                break
            halo = max(estimate.halo_bytes_forward) / batch
            messages = sum(1 for rows_in in estimate.halo_rows.values() if any(rows_in))
        out[k] = replace(layer, spatial=True, halo_bytes=halo, halo_messages=messages, spatial_rows=rows)
    return out


def _time_layers(
    model: Any,
    example_input: Callable[[int], Any],
    units: list[tuple[str, Any]],
    order: list[int],
    batches: tuple[int, int],
    reps: int,
) -> tuple[list[tuple[float, float]], float]:
    """Per layer (fixed s, per-sample s) of forward, fitted over two batch sizes; and backward / forward."""
    import torch

    index = {id(module): i for i, (_, module) in enumerate(units)}
    started = [0.0] * len(units)
    elapsed = [0.0] * len(units)

    def pre(module: Any, _args: Any) -> None:
        started[index[id(module)]] = time.perf_counter()

    def post(module: Any, _args: Any, _out: Any) -> None:
        i = index[id(module)]
        elapsed[i] = time.perf_counter() - started[i]

    def total(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.float().sum()
        return sum(total(v) for v in (value.values() if isinstance(value, dict) else value))

    handles = [m.register_forward_pre_hook(pre) for _, m in units] + [m.register_forward_hook(post) for _, m in units]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what one rank with OMP_NUM_THREADS=1 gets
    samples: dict[int, list[list[float]]] = {}
    ratios = []
    try:
        for b in batches:
            inputs = example_input(b)
            samples[b] = []
            for rep in range(reps + 1):
                start = time.perf_counter()
                out = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
                forward = time.perf_counter() - start
                loss = total(out)
                start = time.perf_counter()
                loss.backward()
                backward = time.perf_counter() - start
                model.zero_grad(set_to_none=True)
                if rep:  # the first pass warms up
                    samples[b].append(list(elapsed))
                    ratios.append(backward / forward if forward > 0 else 2.0)
    finally:
        torch.set_num_threads(threads)
        for handle in handles:
            handle.remove()
    b1, b2 = batches
    # Medians over the repetitions: the statistic validate reports for whole steps.
    best = {b: [statistics.median(column) for column in zip(*rows)] for b, rows in samples.items()}
    fits = []
    for i in order:
        per_sample = max((best[b2][i] - best[b1][i]) / (b2 - b1), 0.0)
        fits.append((max(best[b1][i] - per_sample * b1, 0.0), per_sample))
    return fits, statistics.median(ratios)


def _busiest(blocks: list[tuple[list[float], list[float]]], total: float, which: int, most: int) -> tuple[float, ...]:
    """For tp = 1 .. `most`: the fraction of a unit's tp-split `total` (FLOPs: `which` 0, parameters: 1) on its
    busiest tp rank. Each `Branches` block (per-branch FLOPs, per-branch parameters) is placed whole, by parameter
    count (`Plan` spreads blocks so), and merges before the next: for FLOPs the busiest rank of each block adds
    up, parameters add up per rank; what else the unit splits over tp divides evenly."""
    from hpdl.parallel.branch.placement import loads, place

    if not blocks or total <= 0:
        return ()
    even = total - sum(sum(block[which]) for block in blocks)
    shares = []
    for tp in range(1, most + 1):
        per_rank = [max(even, 0.0) / tp] * tp  # parameters: what each rank holds of every block
        busiest = max(even, 0.0) / tp  # FLOPs: the blocks run one after another, each at its busiest rank's pace
        for block in blocks:
            owner = place([max(1.0, p) for p in block[1]], tp)
            load = loads(block[which], owner, tp)
            busiest += max(load)
            per_rank = [a + b for a, b in zip(per_rank, load)]
        shares.append((max(per_rank) if which else busiest) / total)
    return tuple(shares)


def _tp_modules(module: Any, unit_name: str, tp_plan: dict[str, str]) -> list[tuple[Any, str]]:
    """(submodule, style) for every submodule of a unit that `tp_plan` names (patterns on full names)."""
    import fnmatch

    found = []
    for sub, m in module.named_modules():
        full = f"{unit_name}.{sub}" if sub else unit_name
        for pattern, style in tp_plan.items():
            if fnmatch.fnmatchcase(full, pattern):
                found.append((m, style))
                break
    return found


# --------------------------------------------------------------------------- user models
def load_factory(spec: str) -> tuple[Callable[..., Any], Optional[Callable[[int], Any]]]:
    """`path/to/file.py:factory` or `package.module:factory` -> (factory, example_input or None).

    `example_input(batch)` is looked up beside the factory in the same
    module; the planner needs it to run the model once.
    """
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ProfileError(f"--model {spec!r}: use path/to/model.py:factory or package.module:factory")
    if target.endswith(".py") or os.sep in target:
        if not os.path.exists(target):
            raise ProfileError(f"--model {spec!r}: file {target!r} does not exist")
        mod_name = f"_hpdl_plan_model_{abs(hash(os.path.abspath(target)))}"
        module_spec = importlib.util.spec_from_file_location(mod_name, target)
        if module_spec is None or module_spec.loader is None:
            raise ProfileError(f"--model {spec!r}: cannot import {target!r}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ProfileError(f"--model {spec!r}: cannot import {target!r}: {exc}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ProfileError(f"--model {spec!r}: {target!r} has no callable {attr!r}")
    example = getattr(module, "example_input", None)
    return factory, example if callable(example) else None


def measure_factory(
    spec: str,
    *,
    meta_above: float = 5e8,
    example_input: Optional[Callable[[int], Any]] = None,
    kwargs: Optional[dict[str, Any]] = None,
    sample: str = "sample",
    meta_activations_above: float = 1e9,
) -> ModelProfile:
    """Build the model of `spec` and measure it; on the meta device when it has over `meta_above` parameters
    or its forward on the profiling batch would save over `meta_activations_above` bytes (a CNN on a large
    image: what spatial parallelism is for, and more than this machine's memory)."""
    import torch

    factory, found = load_factory(spec)
    example = example_input or found
    if example is None:
        raise ProfileError(
            f"--model {spec!r}: define `example_input(batch)` beside the factory (it returns the input tensor or "
            "tuple for `batch` samples), so that the planner can run the model once"
        )
    with torch.device("meta"):
        probe = factory(**(kwargs or {}))
    count = sum(p.numel() for p in probe.parameters())
    if count > meta_above:
        return measure(probe, example, name=spec, sample=sample)
    shapes = measure(probe, example, name=spec, sample=sample)  # exact shapes and FLOPs, nothing allocated
    if sum(layer.activation_bytes for layer in shapes.layers) * 2 > meta_activations_above:  # measure's batch
        return shapes
    return measure(factory(**(kwargs or {})), example, name=spec, sample=sample)
