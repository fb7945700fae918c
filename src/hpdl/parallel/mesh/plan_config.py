"""`Plan`: one typed, validated description of how a model is trained in parallel.

    plan = hpdl.parallel.Plan(dp=2, pp=2, tp=1, zero_stage=2, micro_batches=4, schedule="1f1b")
    plan = hpdl.parallel.Plan.from_file("plan.toml")   # the same fields, one to one
    plan = plan.validate(world_size=comm.size, model=model)   # -1 degrees inferred; bad combinations rejected

A plan holds degrees (dp x pp x tp x sp), the ZeRO stage over the data-parallel
group, pipeline micro-batches, schedule and recomputation, the gradient
bucket size, wire compression, mixed precision, the tensor-parallel layer
plan (name pattern -> style) and the rank placement. Every check that does
not need the world runs in `__post_init__`; the checks that need the world
size or the model run in `validate`, before any work starts, and every
error names the field, the value and what to do (torchtitan's
`parallel_dims.py`; mpi4py's `rc`, which rejects unknown options).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from hpdl.parallel.branch.block import BRANCH_STYLE, Branches, branch_plan, branch_problem, nested_in_branches
from hpdl.parallel.tensor.styles import TP_STYLES
from hpdl.parallel.tensor.styles import split_problem as _tensor_split_problem

__all__ = [
    "Plan", "PlanError", "TP_STYLES", "PLAN_STYLES", "AXES", "DEGREES", "full_placement", "resolve_degrees",
    "split_problem",
]  # fmt: skip

AXES = ("tp", "sp", "dp", "pp")
PLAN_STYLES = {
    **TP_STYLES,
    BRANCH_STYLE: "BranchParallel: a Branches block's independent branches spread over the tp ranks, merged by one "
    "collective (the output whole on every rank): sub-graph parallelism (SUPER)",
}
"""The styles a plan's `tp_plan` may name: the tensor-parallel ones and "branch"."""


def split_problem(module: Any, style: str, tp: int) -> str:
    """Why `module` cannot be split `tp` ways in `style` ('' when it can)."""
    return branch_problem(module, tp) if style == BRANCH_STYLE else _tensor_split_problem(module, style, tp)


"""Mesh axes; `Plan.placement` orders them from innermost (consecutive ranks) to outermost."""
DEGREES = ("dp", "pp", "tp", "sp")
"""The degrees in the order plans and meshes print them."""

SCHEDULES = ("gpipe", "1f1b")
RECOMPUTE = ("never", "except_last", "always")
COMPRESSIONS = (None, "fp16", "bf16")
MIXED_PRECISION = (None, "bf16")
ZERO_STAGES = (0, 1, 2, 3)


class PlanError(ValueError):
    """A plan that cannot run: the message names the field(s), the value(s) and the fix."""


if sys.version_info >= (3, 10):
    _dataclass_options: dict[str, Any] = {"frozen": True, "kw_only": True}
else:  # pragma: no cover - keyword-only fields arrived in Python 3.10
    _dataclass_options = {"frozen": True}


@dataclass(**_dataclass_options)
class Plan:
    """How to train in parallel; every field has a default that means 'off'.

    Build it with keywords, or from a TOML/JSON file with `Plan.from_file`.
    Call `validate(world_size, model)` to infer -1 degrees and check it
    against the world and the model before training.
    """

    dp: int = -1
    """Data-parallel degree: replicas that each see a different slice of the batch (-1: the rest of the world)."""
    pp: int = 1
    """Pipeline-parallel degree: stages the model's sequence of layers is split into (-1: infer)."""
    tp: int = 1
    """Tensor-parallel degree: ranks that split each layer's weights (-1: infer); keep it inside a node."""
    sp: int = 1
    """Spatial degree: ranks that split each sample's activations along `spatial_dim` and exchange halos
    (`hpdl.parallel.spatial`, for CNNs whose activations do not fit); -1: infer. Keep it inside a node."""
    spatial_dim: Any = 2
    """The dimension the spatial group splits (2: height of NCHW, also depth of NCDHW), or a list of them for
    blocks on a grid ([2, 3]: height x width); used when sp > 1."""
    spatial_grid: Optional[list[int]] = None
    """Ranks per split dimension of a list `spatial_dim`, multiplying to sp (None: the most even grid)."""
    spatial_stages: int = 1
    """With sp > 1 and pp > 1: how many leading pipeline stages split their activations over sp (MPI4DL's
    spatial + layer parallelism); the later stages run whole on each rank of the spatial group."""
    zero_stage: int = 0
    """ZeRO stage over the data-parallel group: 0 off, 1 optimizer state, 2 + gradients, 3 + parameters (each
    pipeline stage's parameters, and each tp slice, sharded over its dp group)."""
    reshard_after_forward: bool = True
    """ZeRO-3 (FSDP2's option): true gathers each unit for every micro-batch's forward and again for its
    backward; false keeps a stage's units gathered from their first forward to the step's reducing backward
    (fewer all-gathers, the stage's full parameters held during the step)."""
    micro_batches: int = 1
    """Micro-batches per step in the pipeline (pp > 1); 1F1B needs at least pp of them."""
    schedule: Optional[str] = None
    """Pipeline schedule, "gpipe" or "1f1b" (None: "1f1b" when pp > 1); needs pp > 1."""
    recompute: str = "never"
    """Activation recomputation in the pipeline: "never", "except_last" (stages but the last) or "always"."""
    balance: Optional[list[int]] = None
    """Layers per pipeline stage (None: equal counts), e.g. [3, 2] puts 3 layers on stage 0 and 2 on stage 1."""
    bucket_mb: float = 25.0
    """Megabytes per gradient bucket of the data-parallel reduction (smaller overlaps earlier)."""
    compression: Optional[str] = None
    """Wire dtype of the data-parallel gradient reduction: None, "fp16" or "bf16"."""
    mixed_precision: Optional[str] = None
    """None, or "bf16": bf16 parameters for compute with fp32 master copies (needs zero_stage >= 1)."""
    tp_plan: Optional[dict[str, str]] = None
    """Tensor-parallel layers: fnmatch pattern on module names -> style (see PLAN_STYLES: TP_STYLES and
    "branch"); None: the model's own `tp_plan` attribute (hpdl.models.gpt provides one), else "branch" for
    every `hpdl.parallel.Branches` block of the model."""
    placement: tuple[str, ...] = AXES
    """Axes from innermost (consecutive ranks, one node) to outermost: the default ("tp", "sp", "dp", "pp")
    keeps tensor and spatial parallelism inside a node and puts pipeline stages across nodes. A placement of
    the three axes before "sp" existed (a plan file of an earlier hpdl) gets "sp" right after "tp"."""

    # ------------------------------------------------------------------ checks without the world
    def __post_init__(self) -> None:
        for name in DEGREES:
            _check_degree(name, getattr(self, name))
        inferred = [name for name in DEGREES if getattr(self, name) == -1]
        if len(inferred) > 1:
            raise PlanError(f"Plan: at most one degree may be -1 (inferred); got {', '.join(inferred)} = -1")
        _check_int("zero_stage", self.zero_stage, ZERO_STAGES)
        _check_int("micro_batches", self.micro_batches, None)
        if self.micro_batches < 1:
            raise PlanError(f"Plan: micro_batches={self.micro_batches} must be >= 1")
        _check_choice("schedule", self.schedule, (None, *SCHEDULES))
        _check_choice("recompute", self.recompute, RECOMPUTE)
        _check_choice("compression", self.compression, COMPRESSIONS)
        _check_choice("mixed_precision", self.mixed_precision, MIXED_PRECISION)
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, (int, float)) or self.bucket_mb <= 0:
            raise PlanError(f"Plan: bucket_mb={self.bucket_mb!r} must be a positive number of megabytes")
        object.__setattr__(self, "bucket_mb", float(self.bucket_mb))
        if self.tp_plan is not None:
            if not isinstance(self.tp_plan, Mapping):
                raise PlanError(f"Plan: tp_plan must map name patterns to styles, got {type(self.tp_plan).__name__}")
            for pattern, style in self.tp_plan.items():
                if not isinstance(pattern, str) or style not in PLAN_STYLES:
                    raise PlanError(
                        f"Plan: tp_plan[{pattern!r}] = {style!r}: the style must be one of {sorted(PLAN_STYLES)}"
                    )
            object.__setattr__(self, "tp_plan", dict(self.tp_plan))
        if self.balance is not None:
            if not isinstance(self.balance, (list, tuple)) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.balance
            ):
                raise PlanError(
                    f"Plan: balance={self.balance!r} must be a list of positive layer counts, one per stage"
                )
            object.__setattr__(self, "balance", list(self.balance))
            if self.pp != -1 and len(self.balance) != self.pp:
                raise PlanError(f"Plan: balance={self.balance} lists {len(self.balance)} stages but pp={self.pp}")
        placement = full_placement(self.placement)
        if sorted(placement) != sorted(AXES):
            raise PlanError(
                f"Plan: placement={list(self.placement)} must order the axes {list(AXES)} "
                "from innermost (consecutive ranks) to outermost"
            )
        object.__setattr__(self, "placement", placement)
        self._check_spatial()
        if self.pp == 1 and self.schedule is not None:
            raise PlanError(f"Plan: schedule={self.schedule!r} needs pipeline stages (pp > 1); pp is 1")
        if self.pp == 1 and self.micro_batches > 1:
            raise PlanError(
                f"Plan: micro_batches={self.micro_batches} needs pipeline stages (pp > 1); without a pipeline, "
                "accumulate gradients with model.no_sync() in the training loop"
            )
        if self.pp == 1 and self.recompute != "never":
            raise PlanError(f"Plan: recompute={self.recompute!r} applies to pipeline stages (pp > 1); pp is 1")
        if self.mixed_precision is not None and self.zero_stage == 0:
            raise PlanError(
                f"Plan: mixed_precision={self.mixed_precision!r} keeps fp32 master copies in the ZeRO optimizer; "
                "set zero_stage to 1, 2 or 3, or mixed_precision to None"
            )
        if self.compression is not None and self.zero_stage != 0:
            raise PlanError(
                f"Plan: compression={self.compression!r} applies to DataParallel's allreduce; ZeRO (zero_stage="
                f"{self.zero_stage}) reduces in the gradients' own dtype: set compression to None or zero_stage to 0"
            )
        if not isinstance(self.reshard_after_forward, bool):
            raise PlanError(f"Plan: reshard_after_forward={self.reshard_after_forward!r} must be true or false")
        if not self.reshard_after_forward and self.zero_stage != 3:
            raise PlanError(
                "Plan: reshard_after_forward=false keeps ZeRO-3's gathered parameters across a step's micro-batches; "
                f"zero_stage is {self.zero_stage}: set zero_stage=3, or leave reshard_after_forward true"
            )

    def _check_spatial(self) -> None:
        from hpdl.parallel.spatial.grid import normalize_split

        dims = self.spatial_dim
        if isinstance(dims, (list, tuple)):
            dims = tuple(dims)
            object.__setattr__(self, "spatial_dim", dims)
        else:
            _check_int("spatial_dim", dims, None)
            if dims < 2:
                raise PlanError(
                    f"Plan: spatial_dim={dims} must be 2 or more (0 is the batch, 1 the channels; "
                    "2 is the height of NCHW)"
                )
        grid = self.spatial_grid
        if grid is not None:
            if not isinstance(dims, tuple):
                raise PlanError(
                    f"Plan: spatial_grid={grid!r} needs a list spatial_dim (one split dimension per factor), "
                    f"got spatial_dim={dims}"
                )
            if not isinstance(grid, (list, tuple)) or not all(
                isinstance(g, int) and not isinstance(g, bool) for g in grid
            ):
                raise PlanError(f"Plan: spatial_grid={grid!r} must be a list of ints, one per split dimension")
            object.__setattr__(self, "spatial_grid", list(grid))
        try:  # the grid against sp once sp is known (-1: the mesh infers it and SpatialParallel checks)
            normalize_split(dims, grid, self.sp if self.sp > 0 else math.prod(grid or (1,)), "Plan")
        except ValueError as exc:
            raise PlanError(f"{exc} (spatial_dim, spatial_grid, sp)") from None
        _check_int("spatial_stages", self.spatial_stages, None)
        if self.pp > 0 and not 1 <= self.spatial_stages <= self.pp:
            raise PlanError(
                f"Plan: spatial_stages={self.spatial_stages} must be 1..pp ({self.pp}): the leading stages that run "
                "spatially"
            )
        if self.sp == 1:
            return
        others = [f"tp={self.tp}"] if self.tp != 1 else []
        if self.zero_stage:
            others.append(f"zero_stage={self.zero_stage}")
        if self.compression is not None:
            others.append(f"compression={self.compression!r}")
        if others:
            raise PlanError(
                f"Plan: sp={self.sp} (spatial) combines with dp and pp only; got {', '.join(others)}. Split the "
                "convolutions' channels with the 'filter'/'channel' tp styles instead, or use dp for more ranks "
                "(docs/spatial.md)"
            )

    # ------------------------------------------------------------------ derived values
    @property
    def pipeline_schedule(self) -> Optional[str]:
        """The schedule that runs: `schedule`, or "1f1b" when pp > 1 and none is named; None without a pipeline."""
        if self.pp == 1:
            return None
        return self.schedule or "1f1b"

    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DEGREES}

    # ------------------------------------------------------------------ checks with the world and the model
    def validate(self, world_size: int, model: Any = None) -> Plan:
        """Return this plan with -1 degrees inferred, after checking it against the world and `model`.

        Raises PlanError naming every factor when the degrees do not
        multiply to `world_size`, when 1F1B has fewer micro-batches than
        stages, when a model has fewer layers than stages, or when tp does
        not divide a split dimension (attention heads, features, vocabulary)
        of a layer the tp plan names.
        """
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise PlanError(f"Plan.validate: world_size={world_size!r} must be a positive int")
        degrees = resolve_degrees(world_size, self.dp, self.pp, self.tp, self.sp)
        plan = dataclasses.replace(self, dp=degrees["dp"], pp=degrees["pp"], tp=degrees["tp"], sp=degrees["sp"])
        if plan.balance is not None and len(plan.balance) != plan.pp:
            raise PlanError(f"Plan: balance={plan.balance} lists {len(plan.balance)} stages but pp={plan.pp}")
        if plan.pipeline_schedule == "1f1b" and plan.micro_batches < plan.pp:
            raise PlanError(
                f"Plan: schedule '1f1b' needs micro_batches >= pp; micro_batches={plan.micro_batches}, pp={plan.pp}. "
                f"Use micro_batches={plan.pp} or more (4 x pp keeps the bubble small), or schedule='gpipe'"
            )
        if model is not None:
            plan._check_model(model)
        return plan

    def _check_model(self, model: Any) -> None:
        from torch import nn

        if not isinstance(model, nn.Module):
            raise PlanError(f"Plan.validate: model must be an nn.Module, got {type(model).__name__}")
        if self.pp > 1:
            layers = len(model) if isinstance(model, nn.Sequential) else None
            if layers is None:
                raise PlanError(
                    f"Plan: pp={self.pp} splits an nn.Sequential into stages; {type(model).__name__} is not one. "
                    "Express the model as an nn.Sequential of layers (hpdl.models.gpt.GPT is one)"
                )
            if layers < self.pp:
                raise PlanError(f"Plan: pp={self.pp} stages but the model has only {layers} layers")
            if self.balance is not None and sum(self.balance) != layers:
                raise PlanError(
                    f"Plan: balance={self.balance} places {sum(self.balance)} layers; the model has {layers}"
                )
        if self.tp == 1:
            return
        patterns = self.tp_plan_for(model)
        if not patterns and isinstance(model, Branches):
            raise PlanError(
                f"Plan: tp={self.tp} would spread the model's branches, but the model is itself a Branches block, "
                "which a plan cannot replace in place: wrap it, nn.Sequential(block), and build that"
            )
        if not patterns:
            raise PlanError(
                f"Plan: tp={self.tp} but no tp_plan names layers to split, and {type(model).__name__} has no "
                "tp_plan attribute; give tp_plan={'*.fc': 'column', '*.proj': 'row', ...}"
            )
        names = dict(model.named_modules())
        for pattern, style in patterns.items():
            matched = [n for n in names if n and fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                raise PlanError(f"Plan: tp_plan pattern {pattern!r} ({style}) matches no module of the model")
            for name in matched:
                problem = split_problem(names[name], style, self.tp)
                if problem:
                    raise PlanError(f"Plan: tp={self.tp} cannot split {name} ({style}): {problem}")
        nested = nested_in_branches(model, patterns)
        if nested:
            raise PlanError(
                f"Plan: tp_plan splits {', '.join(nested[:3])} inside a 'branch' block, whose branches each live on "
                "one tp rank: a layer of a branch cannot also be split over the tp ranks; leave the branches whole"
            )
        if self.zero_stage and BRANCH_STYLE in patterns.values():
            raise PlanError(
                f"Plan: branch parallelism ('branch' in tp_plan) with zero_stage={self.zero_stage}: ZeRO's gradient "
                "norm and checkpoints do not know that each tp rank holds other branches yet; use zero_stage=0"
            )
        heads = _heads(model)
        if heads is not None and heads % self.tp:
            raise PlanError(f"Plan: tp={self.tp} must divide the number of attention heads ({heads})")

    def tp_plan_for(self, model: Any) -> dict[str, str]:
        """The tensor-parallel plan that applies to `model`: this plan's, else the model's `tp_plan` attribute,
        else its `Branches` blocks spread over the tp ranks."""
        if self.tp_plan is not None:
            return dict(self.tp_plan)
        own = getattr(model, "tp_plan", None)
        return dict(own) if isinstance(own, Mapping) else branch_plan(model)

    # ------------------------------------------------------------------ files
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "plan") -> Plan:
        """Build a plan from a mapping whose keys are exactly field names (unknown keys are an error)."""
        if not isinstance(data, Mapping):
            raise PlanError(f"{source}: a plan is a table of fields, got {type(data).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in data if k not in valid]
        if unknown:
            raise PlanError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(valid)}")
        values = dict(data)
        if "placement" in values and isinstance(values["placement"], (list, tuple)):
            values["placement"] = tuple(values["placement"])
        for key in ("schedule", "compression", "mixed_precision", "tp_plan", "balance", "spatial_grid"):
            if values.get(key) == "none":  # TOML has no null: "none" stands for None
                values[key] = None
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Every field by name (what `to_file` writes and `from_dict` reads)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["placement"] = list(self.placement)
        if self.tp_plan is not None:
            out["tp_plan"] = dict(self.tp_plan)
        if self.balance is not None:
            out["balance"] = list(self.balance)
        if isinstance(self.spatial_dim, tuple):
            out["spatial_dim"] = list(self.spatial_dim)
        return out

    @classmethod
    def from_file(cls, path: str) -> Plan:
        """Read a plan from a .toml or .json file whose keys map one to one onto the fields."""
        if not os.path.exists(path):
            raise PlanError(f"Plan.from_file: {path} does not exist")
        if path.endswith(".json"):
            with open(path) as handle:
                try:
                    data = json.load(handle)
                except json.JSONDecodeError as exc:
                    raise PlanError(f"{path}: not valid JSON: {exc}") from None
        elif path.endswith(".toml"):
            data = _read_toml(path)
        else:
            raise PlanError(f"Plan.from_file: {path}: the name must end in .toml or .json")
        return cls.from_dict(data, source=path)

    def to_file(self, path: str) -> str:
        """Write the plan as .toml or .json (every field, so the file documents the whole plan); return the path."""
        data = self.to_dict()
        if path.endswith(".json"):
            text = json.dumps(data, indent=2) + "\n"
        elif path.endswith(".toml"):
            text = _to_toml(data)
        else:
            raise PlanError(f"Plan.to_file: {path}: the name must end in .toml or .json")
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
        return path

    def describe(self) -> str:
        """A few lines for logs: degrees, ZeRO, pipeline and tensor-parallel settings."""
        kept = "" if self.reshard_after_forward else " (units kept gathered across micro-batches)"
        lines = [
            f"mesh      {' x '.join(f'{a}={getattr(self, a)}' for a in DEGREES)} (placement, innermost first: "
            f"{', '.join(self.placement)})",
            f"zero      stage {self.zero_stage} over the dp group{kept}; bucket {self.bucket_mb:g} MB; "
            f"compression {self.compression}; mixed precision {self.mixed_precision}",
        ]
        if self.pp > 1:
            lines.append(
                f"pipeline  {self.pipeline_schedule}, {self.micro_batches} micro-batches, recompute {self.recompute}, "
                f"balance {self.balance or 'equal layer counts'}"
            )
        if self.tp != 1:
            styles = ", ".join(f"{k}: {v}" for k, v in (self.tp_plan or {}).items()) or "the model's own tp_plan"
            lines.append(f"tensor    {styles}")
        if self.sp != 1:
            stages = f", pipeline stages 0..{self.spatial_stages - 1}" if self.pp > 1 else ""
            if isinstance(self.spatial_dim, tuple):
                from hpdl.parallel.spatial.grid import grid_shape

                grid = " x ".join(map(str, self.spatial_grid or grid_shape(self.sp, len(self.spatial_dim))))
                lines.append(
                    f"spatial   each sample split in {self.sp} blocks ({grid}) along dims {self.spatial_dim}{stages}"
                )
            else:
                lines.append(f"spatial   each sample split in {self.sp} slabs along dim {self.spatial_dim}{stages}")
        return "\n".join(lines)


# ---------------------------------------------------------------------- helpers
def full_placement(placement: Any) -> tuple[str, ...]:
    """`placement` as a tuple; one of the three axes before "sp" existed gets "sp" right after "tp"."""
    placement = tuple(placement)
    if "sp" not in placement and sorted(placement) == sorted(a for a in AXES if a != "sp"):
        at = placement.index("tp") + 1
        placement = (*placement[:at], "sp", *placement[at:])
    return placement


def resolve_degrees(world_size: int, dp: int, pp: int, tp: int, sp: int = 1) -> dict[str, int]:
    """dp, pp, tp, sp with one -1 inferred; PlanError printing every factor when they cannot make `world_size`."""
    degrees = {"dp": dp, "pp": pp, "tp": tp, "sp": sp}
    for name, value in degrees.items():
        _check_degree(name, value)
    unknown = [k for k, v in degrees.items() if v == -1]
    if len(unknown) > 1:
        raise PlanError(f"at most one degree may be -1 (inferred); got {', '.join(unknown)} = -1")
    known = math.prod(v for v in degrees.values() if v != -1)
    if unknown:
        if world_size % known:
            factors = " * ".join(f"{k}({v})" for k, v in degrees.items() if v != -1 and (k, v) != ("sp", 1))
            raise PlanError(
                f"{unknown[0]} = -1 cannot be inferred: {factors} = {known} does not divide world size {world_size}"
            )
        degrees[unknown[0]] = world_size // known
    product = math.prod(degrees.values())
    if product != world_size:
        factors = " * ".join(f"{k}({v})" for k, v in degrees.items() if (k, v) != ("sp", 1))
        raise PlanError(f"{factors} != world size {world_size}: the degrees must multiply to the number of ranks")
    return degrees


def _check_degree(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise PlanError(f"Plan: {name}={value!r} must be a positive int, or -1 to infer it from the world size")


def _check_int(name: str, value: Any, choices: Optional[tuple]) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanError(f"Plan: {name}={value!r} must be an int")
    if choices is not None and value not in choices:
        raise PlanError(f"Plan: {name}={value!r} must be one of {list(choices)}")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise PlanError(f"Plan: {name}={value!r} must be one of {list(choices)}")


def _heads(model: Any) -> Optional[int]:
    """The attention head count when the model declares one (config.n_head or an attention module's n_head)."""
    config = getattr(model, "config", None)
    for holder in (config, model):
        for attr in ("n_head", "num_heads", "num_attention_heads"):
            value = getattr(holder, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _read_toml(path: str) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python < 3.11
        try:
            import tomli as tomllib
        except ImportError:
            raise PlanError(f"{path}: reading TOML on Python < 3.11 needs `pip install tomli` (or use JSON)") from None
    with open(path, "rb") as handle:
        try:
            return tomllib.load(handle)
        except tomllib.TOMLDecodeError as exc:
            raise PlanError(f"{path}: not valid TOML: {exc}") from None


def _toml_value(value: Any) -> str:
    if value is None:
        return '"none"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise PlanError(f"cannot write {value!r} to TOML")


def _to_toml(data: Mapping[str, Any]) -> str:
    """The plan as TOML: scalars first, then the tp_plan table; None fields are left out (absent = None)."""
    lines = ["# hpdl parallel plan (hpdl.parallel.Plan): keys map one to one onto its fields; absent = None"]
    for key, value in data.items():
        if key != "tp_plan" and value is not None:
            lines.append(f"{key} = {_toml_value(value)}")
    table = data.get("tp_plan")
    if table is not None:
        lines += ["", "[tp_plan]"] + [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"
