"""Search: every (dp, pp, tp, ZeRO stage, micro-batches, schedule, recomputation) hpdl can run, ranked.

The space is the one `hpdl.parallel.Plan` accepts: dp x pp x tp equals the
devices; tp stays inside a node, divides the attention heads and has a
`Branches` block's branch for each rank; micro-
batches, schedules and recomputation only with a pipeline (1F1B needs
m >= pp); ZeRO 1-3 with every dp x pp x tp (ZeRO-3 shards each stage's
parameters, tp slices included, over its dp group) and, with a pipeline,
ZeRO-3 resharding after each forward or keeping the units gathered across
the micro-batches (`reshard_after_forward`); mixed
precision keeps fp32 master copies in the ZeRO optimizer, so it needs a
ZeRO stage >= 1. Candidates that do not fit in device memory are kept (and
reported) but never chosen. One estimate costs O(stages) after a per-(pp, tp)
table is built once, so thousands of candidates take well under a second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

from hpdl.plan.cluster import Cluster
from hpdl.plan.cost import RECOMPUTE, Candidate, CostModel, Estimate, Workload
from hpdl.plan.profile import ModelProfile

__all__ = ["SearchResult", "search", "candidates", "divisors", "plan_fields"]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    profile: ModelProfile,
    cluster: Cluster,
    workload: Workload,
    *,
    devices: Optional[int] = None,
    max_micro_batches: int = 256,
    schedules: Sequence[str] = ("1f1b", "gpipe"),
    recompute: Sequence[str] = RECOMPUTE,
    zero_stages: Sequence[int] = (0, 1, 2, 3),
    max_tp: Optional[int] = None,
    spatial: bool = True,
) -> Iterator[Candidate]:
    """Every candidate plan for `devices` devices (default: the whole cluster) that hpdl can run.

    With `spatial` and a profile whose first layers run on slabs (a CNN), also dp x sp: `sp` ranks split
    each sample along the height (at most one row per slab of the smallest spatial layer), without
    pipeline, tensor parallelism or ZeRO, which SpatialParallel does not compose with in a plan."""
    n = devices or cluster.devices
    layers = len(profile.layers)
    per_node = min(cluster.devices_per_node, n)
    for tp in divisors(per_node):
        if n % tp or not profile.tp_allows(tp) or (max_tp and tp > max_tp):
            continue
        for pp in divisors(n // tp):
            if pp > layers:
                continue
            dp = n // (tp * pp)
            if workload.batch % dp:
                continue
            per_replica = workload.batch // dp
            stages = [z for z in zero_stages if (dp > 1 or z <= 1)]
            if workload.precision != "fp32":
                stages = [z for z in stages if z >= 1]  # Plan: mixed precision lives in the ZeRO optimizer
            else:
                stages = [z for z in stages if dp > 1 or z == 0]
            for zero in stages:
                if zero and tp > 1 and profile.branched:
                    continue  # Plan: branch parallelism does not combine with ZeRO (yet)
                if pp == 1:
                    yield Candidate(dp, 1, tp, zero, 1, "1f1b", "never")
                    continue
                for m in divisors(per_replica):
                    if m > max_micro_batches:
                        break
                    for schedule in schedules:
                        if (schedule == "1f1b" and m < pp) or (schedule == "gems" and (m % 2 or zero or tp > 1)):
                            continue  # gems: an even m; its copies' reduction takes neither ZeRO nor tp
                        for rc in recompute:
                            yield Candidate(dp, pp, tp, zero, m, schedule, rc)
                            if zero == 3 and m > 1:  # keep the units gathered across the micro-batches
                                yield Candidate(dp, pp, tp, zero, m, schedule, rc, reshard=False)
    if spatial:
        for sp in divisors(n)[1:]:
            if sp <= profile.spatial_limit() and workload.batch % (n // sp) == 0:
                yield Candidate(n // sp, 1, 1, 0, 1, "1f1b", "never", sp=sp)


@dataclass
class SearchResult:
    """Every estimate, feasible ones first by predicted step time, and what the search cost."""

    profile: ModelProfile
    cluster: Cluster
    workload: Workload
    estimates: list[Estimate]
    """All candidates: the ones that fit sorted by step time (then memory), then the rest by memory."""
    elapsed_s: float
    devices: int
    notes: list[str] = field(default_factory=list)

    @property
    def feasible(self) -> list[Estimate]:
        return [e for e in self.estimates if e.fits]

    @property
    def best(self) -> Optional[Estimate]:
        fits = self.feasible
        return fits[0] if fits else None

    def best_plan(self) -> Any:
        """The best estimate as an `hpdl.parallel.Plan` (raises when nothing fits)."""
        if self.best is None:
            raise ValueError("no plan fits in device memory; see the smallest-memory candidates in the report")
        from hpdl.parallel.mesh.plan_config import Plan  # lazy: loading the mesh loads every strategy (~0.4 s)

        return Plan(**plan_fields(self.best.candidate, self.workload, self.best.stage_layers))

    def to_dict(self, top: int = 20) -> dict[str, Any]:
        best = self.best
        return {
            "model": {"name": self.profile.name, "params": self.profile.params, "source": self.profile.source},
            "cluster": self.cluster.to_dict(),
            "workload": self.workload.__dict__,
            "devices": self.devices,
            "candidates": len(self.estimates),
            "feasible": len(self.feasible),
            "elapsed_s": self.elapsed_s,
            "best": best.to_dict() if best else None,
            "plan": plan_fields(best.candidate, self.workload, best.stage_layers) if best else None,
            "spatial": {"dp": best.candidate.dp, "sp": best.candidate.sp} if best and best.candidate.sp > 1 else None,
            "ranking": [e.to_dict() for e in self.feasible[:top]],
            "smallest_memory": [e.to_dict() for e in sorted(self.estimates, key=lambda e: e.memory_bytes)[:3]],
            "notes": list(self.notes),
        }


def plan_fields(c: Candidate, workload: Workload, balance: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """The keyword arguments of `hpdl.parallel.Plan` for candidate `c` (the plan file's keys).

    `balance` (layers per stage, as the cost model split them) is written
    with a pipeline, so that the run uses the split that was predicted.
    """
    fields: dict[str, Any] = {
        "dp": c.dp,
        "pp": c.pp,
        "tp": c.tp,
        "zero_stage": c.zero,
        "micro_batches": c.micro_batches if c.pp > 1 else 1,
        "schedule": c.schedule if c.pp > 1 else None,
        "recompute": c.recompute if c.pp > 1 else "never",
        "bucket_mb": float(workload.bucket_mb),
        "compression": None,
        "mixed_precision": "bf16" if workload.precision != "fp32" and c.zero >= 1 else None,
    }
    if c.zero == 3:
        fields["reshard_after_forward"] = c.reshard
    if c.pp > 1 and balance:
        fields["balance"] = [int(n) for n in balance]
    if c.sp > 1:  # SpatialParallel over the mesh's sp axis, each sample's height split (the profile's spatial dim)
        fields["sp"] = c.sp
    return fields


def search(
    profile: ModelProfile,
    cluster: Cluster,
    workload: Workload,
    *,
    devices: Optional[int] = None,
    measured: bool = False,
    **options: Any,
) -> SearchResult:
    """Estimate every candidate (see `candidates` for `options`) and rank them.

    `measured`: the profile's layers were timed on the machine `cluster`
    describes; use those times rather than FLOPs / rate.
    """
    n = devices or cluster.devices
    if n < 1:
        raise ValueError(f"devices = {n}: plan for at least one device")
    if n > cluster.devices:
        raise ValueError(f"devices = {n} but the cluster has {cluster.devices} ({cluster.nodes} x "
                         f"{cluster.devices_per_node}); give a bigger cluster or fewer devices")  # fmt: skip
    start = time.perf_counter()
    model = CostModel(profile, cluster, workload, measured=measured)
    estimates = [model.estimate(c) for c in candidates(profile, cluster, workload, devices=n, **options)]
    if not estimates:
        raise ValueError(
            f"no candidate plan for {n} devices and a global batch of {workload.batch}: the batch must divide by "
            "the data-parallel degree; try a batch that is a multiple of the device count"
        )
    fits = sorted((e for e in estimates if e.fits), key=lambda e: (e.step_s, e.memory_bytes))
    rest = sorted((e for e in estimates if not e.fits), key=lambda e: e.memory_bytes)
    notes = []
    if not fits:
        notes.append(
            f"nothing fits in {cluster.memory_bytes / 1e9:g} GB per device: the smallest candidate needs "
            f"{rest[0].memory_bytes / 1e9:.3g} GB ({rest[0].candidate.label()})"
        )
    return SearchResult(profile, cluster, workload, fits + rest, time.perf_counter() - start, n, notes)
