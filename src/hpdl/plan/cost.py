"""The cost model: predicted step time and peak memory per device of one parallel plan.

Every number of an `Estimate` is one formula of docs/plan.md, named in the
comments below. In short, for a plan (dp, pp, tp, ZeRO stage z,
m micro-batches of b = B / (dp m) samples, schedule, recomputation):

    per stage i and micro-batch:  t_i = fwd_i + bwd_i + recompute_i + tp_i + p2p_i
    step = m * max_i t_i  +  (sum_i t_i - max_i t_i)  +  exposed dp communication  +  optimizer step
           \\ compute+tp+p2p /   \\ pipeline bubble    /

With equal stages the bubble term is (p - 1) t, the GPipe share
(p - 1) / (m + p - 1) of the pipelined part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from hpdl.plan import collectives as coll
from hpdl.plan.cluster import Cluster
from hpdl.plan.memory import (
    gems_bubble_fraction,
    in_flight,
    optimizer_traffic,
    spatial_activation_bytes,
    state_bytes,
)
from hpdl.plan.profile import ModelProfile

__all__ = ["Workload", "Candidate", "Estimate", "CostModel", "balance", "explain_breakdown", "RECOMPUTE"]

RECOMPUTE = ("never", "except_last", "always")


@dataclass(frozen=True)
class Workload:
    """What is trained: the global batch and the numerics."""

    batch: int
    """Global batch in samples per optimizer step."""
    precision: str = "mixed"
    """"mixed" (bf16 compute, fp32 master copies), "fp32" or "bf16" (pure 16-bit)."""
    optimizer: str = "adam"
    bucket_mb: float = 25.0
    """Gradient bucket size of the data-parallel reduction."""

    def __post_init__(self) -> None:
        if not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"global batch {self.batch!r} must be a positive integer (samples per step)")
        state_bytes(self.optimizer, self.precision)  # raises ValueError naming the choices
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket size {self.bucket_mb!r} MB must be > 0")

    @property
    def compute_dtype(self) -> str:
        return "fp32" if self.precision == "fp32" else "bf16"

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2


@dataclass(frozen=True)
class Candidate:
    """One point of the search space (the fields of `hpdl.parallel.Plan` that change cost)."""

    dp: int
    pp: int
    tp: int
    zero: int = 0
    micro_batches: int = 1
    schedule: str = "1f1b"
    recompute: str = "never"
    sp: int = 1
    """Spatial degree: ranks that split each sample's activations along the height (SpatialParallel), inside
    each data-parallel replica; only without pipeline and tensor parallelism."""
    reshard: bool = True
    """ZeRO-3's `reshard_after_forward`: gather each unit for every micro-batch's forward and backward (True),
    or keep a stage's units gathered across the step's micro-batches (False: fewer all-gathers, more memory)."""

    @property
    def devices(self) -> int:
        return self.dp * self.pp * self.tp * self.sp

    def label(self) -> str:
        text = f"dp{self.dp} pp{self.pp} tp{self.tp} z{self.zero}"
        if self.sp > 1:
            text += f" sp{self.sp}"
        if self.pp > 1:
            text += f" m{self.micro_batches} {self.schedule}"
            if self.recompute != "never":
                text += f" rc:{self.recompute}"
        if self.zero == 3 and not self.reshard:
            text += " keep"
        return text


@dataclass
class Estimate:
    """Predicted step time (with its parts, which sum to it) and peak memory per device of a candidate."""

    candidate: Candidate
    step_s: float
    compute_s: float
    """m x forward + backward (+ recomputation) of the slowest stage, per-layer overhead included."""
    tp_comm_s: float
    """m x the slowest stage's tensor-parallel allreduces (on the critical path)."""
    p2p_s: float
    """m x the slowest stage's pipeline sends (activations forward, gradients backward)."""
    bubble_s: float
    """Pipeline fill and drain: sum of the stages' micro-batch times minus the slowest one."""
    dp_comm_s: float
    """Data-parallel / ZeRO communication not hidden behind backward."""
    optimizer_s: float
    """The optimizer step (memory-bound)."""
    memory_bytes: float
    """Peak bytes per device (the worst stage)."""
    memory: dict[str, float] = field(default_factory=dict)
    """Peak memory by kind: params, grads, optimizer, activations, buffers, reserved."""
    fits: bool = True
    micro_batch: int = 1
    stage_layers: tuple[int, ...] = ()
    samples_per_s: float = 0.0
    halo_s: float = 0.0
    """Spatial halo exchange (forward rows, backward gradients) not hidden behind the interior computation."""

    def to_dict(self) -> dict[str, Any]:
        c = self.candidate
        return {
            "dp": c.dp,
            "pp": c.pp,
            "tp": c.tp,
            "sp": c.sp,
            "zero_stage": c.zero,
            "micro_batches": c.micro_batches,
            "micro_batch_size": self.micro_batch,
            "schedule": c.schedule if c.pp > 1 else None,
            "recompute": c.recompute,
            "reshard_after_forward": c.reshard if c.zero == 3 else None,
            "step_s": self.step_s,
            "samples_per_s": self.samples_per_s,
            "compute_s": self.compute_s,
            "tp_comm_s": self.tp_comm_s,
            "p2p_s": self.p2p_s,
            "bubble_s": self.bubble_s,
            "dp_comm_s": self.dp_comm_s,
            "optimizer_s": self.optimizer_s,
            "halo_s": self.halo_s,
            "memory_GB": self.memory_bytes / 1e9,
            "memory_breakdown_GB": {k: v / 1e9 for k, v in self.memory.items()},
            "fits": self.fits,
            "stage_layers": list(self.stage_layers),
        }


def balance(weights: list[float], parts: int) -> list[int]:
    """Split `weights` into `parts` contiguous non-empty runs minimising the largest sum; returns run lengths.

    The pipeline's own partition (`hpdl.parallel.pipe.balance.partition`, exact dynamic programming), so a
    predicted split is the split balance="auto" makes from the same per-layer costs.
    """
    from hpdl.parallel.pipe.balance import partition  # lazy: `hpdl plan` starts without the strategies (~0.4 s)

    if not 1 <= parts <= len(weights):
        raise ValueError(f"cannot split {len(weights)} layers into {parts} pipeline stages")
    return partition(weights, parts)


@dataclass(frozen=True)
class _Stage:
    """Per-device aggregates of one pipeline stage at one tensor-parallel degree, per sample."""

    layers: int
    ops: int
    tensors: int
    flops: float
    fwd_fixed_s: float
    fwd_per_sample_s: float
    params: float
    activations: float
    checkpoint: float
    """Bytes kept per sample when every layer recomputes: each layer's input."""
    largest_activation: float
    largest_params: float
    tp_fwd_bytes: float
    tp_fwd_count: int
    tp_bwd_bytes: float
    tp_bwd_count: int
    out_bytes: float
    in_bytes: float


class CostModel:
    """Estimates for one (model profile, cluster, workload); caches the per-(pp, tp) stage tables."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, workload: Workload, *, measured: bool = False):
        """`measured`: use the profile's timed layers (taken on this machine) instead of FLOPs / rate."""
        if measured and not profile.timed:
            raise ValueError("CostModel(measured=True) needs a profile with timed layers: measure(..., time_batches=)")
        self.measured = measured
        self.profile = profile.at_dtype(workload.act_bytes)
        self.cluster = cluster
        self.workload = workload
        self.bytes = state_bytes(workload.optimizer, workload.precision)
        self.traffic = optimizer_traffic(workload.optimizer, workload.precision)
        self._stages: dict[tuple[int, int], list[_Stage]] = {}
        self._splits: dict[int, list[int]] = {}

    # ------------------------------------------------------------------ stages
    def busy(self, c: Candidate) -> float:
        """Devices of a node that compute at once: all of the plan's on the node; with a pipeline, each stage
        only for its share of the step, m / (m + p - 1) of it (GPipe's and 1F1B's), while the others wait."""
        active = float(min(self.cluster.devices_per_node, c.devices))
        if c.pp > 1:
            active *= c.micro_batches / (c.micro_batches + c.pp - 1)
        return active

    def rate(self, c: Candidate) -> float:
        """One device's FLOP/s in plan `c`: its share of the node while `busy(c)` devices compute."""
        return self.cluster.rate(self.workload.compute_dtype, self.busy(c))

    def split(self, pp: int) -> list[int]:
        """Layers per stage for `pp` stages, balanced by forward time (FLOPs plus per-layer overhead)."""
        if pp not in self._splits:
            cl = self.cluster
            per_batch = self.workload.batch  # weights in seconds at the whole batch; only their ratios matter
            rate = cl.rate(self.workload.compute_dtype)
            if self.measured:
                weights = [ly.fwd_fixed_s + ly.fwd_per_sample_s * per_batch for ly in self.profile.layers]
            else:
                weights = [
                    ly.flops * per_batch / rate + cl.layer_overhead_s + ly.ops * cl.op_overhead_s
                    for ly in self.profile.layers
                ]
            self._splits[pp] = balance(weights, pp)
        return self._splits[pp]

    def stages(self, pp: int, tp: int) -> list[_Stage]:
        key = (pp, tp)
        if key in self._stages:
            return self._stages[key]
        layers = self.profile.layers
        out: list[_Stage] = []
        start = 0
        for count in self.split(pp):
            chosen = range(start, start + count)
            stage_layers = [layers[i] for i in chosen]
            params = []
            for i in chosen:
                layer = layers[i]
                p = layer.params - layer.tp_params + layer.tp_params * layer.tp_param_share(tp)
                if layer.tied_params and layer.tied_to not in chosen:
                    p += layer.tied_params / tp  # a tied weight whose owner sits on another stage is held twice
                params.append(p)
            acts = [
                ly.activation_bytes - ly.tp_activation_bytes + ly.tp_activation_bytes * ly.tp_share(tp)
                for ly in stage_layers
            ]
            inputs = [layers[i - 1].output_bytes if i > 0 else 0.0 for i in chosen]
            out.append(
                _Stage(
                    layers=count,
                    ops=sum(ly.ops for ly in stage_layers),
                    tensors=sum(ly.tensors for ly in stage_layers),
                    flops=sum(ly.flops - ly.tp_flops + ly.tp_flops * ly.tp_share(tp) for ly in stage_layers),
                    fwd_fixed_s=sum(ly.fwd_fixed_s for ly in stage_layers),
                    # the share of a layer's time that tensor parallelism divides: its share of the FLOPs (of which
                    # the busiest tp rank runs tp_share: 1 / tp, or more where whole branches do not split evenly)
                    fwd_per_sample_s=sum(
                        ly.fwd_per_sample_s * (1 - (ly.tp_flops / ly.flops if ly.flops else 0) * (1 - ly.tp_share(tp)))
                        for ly in stage_layers
                    ),
                    params=sum(params),
                    activations=sum(acts),
                    checkpoint=sum(inputs),
                    largest_activation=max(acts),
                    largest_params=max(params),
                    tp_fwd_bytes=sum(ly.tp_allreduce_fwd * ly.output_bytes for ly in stage_layers),
                    tp_fwd_count=sum(ly.tp_allreduce_fwd for ly in stage_layers),
                    tp_bwd_bytes=sum(ly.tp_allreduce_bwd * ly.output_bytes for ly in stage_layers),
                    tp_bwd_count=sum(ly.tp_allreduce_bwd for ly in stage_layers),
                    out_bytes=stage_layers[-1].output_bytes,
                    in_bytes=inputs[0],
                )
            )
            start += count
        self._stages[key] = out
        return out

    # ------------------------------------------------------------------ one candidate
    def estimate(self, c: Candidate) -> Estimate:
        """Predicted step time and memory of candidate `c` (see the module docstring and docs/plan.md)."""
        if c.sp > 1:
            return self._spatial(c)
        cl, wl = self.cluster, self.workload
        m = c.micro_batches
        b = wl.batch / (c.dp * m)
        stages = self.stages(c.pp, c.tp)
        p = len(stages)
        stride_pp = c.dp * c.tp
        g = cl.devices_per_node
        per_stage = []
        seen: dict[tuple, tuple] = {}
        kinds = {s: k for k, s in enumerate(dict.fromkeys(stages))}  # equal stages (same layers) share a kind
        for i, s in enumerate(stages):
            recomputes = c.recompute == "always" or (c.recompute == "except_last" and i < p - 1)
            link_out = self._pp_link(i, stride_pp, g) if i < p - 1 else None
            link_in = self._pp_link(i - 1, stride_pp, g) if i > 0 else None
            alive = in_flight(c.schedule, p, m, i) if p > 1 else 1
            # Stages of one kind with the same neighbours cost the same: compute each once.
            key = (kinds[s], recomputes, link_out is None or link_out.name, link_in is None or link_in.name)
            if key not in seen:
                seen[key] = self._stage(c, s, b, recomputes, link_out, link_in, p)
            t = seen[key]
            acts = t[6] * alive + t[7]
            per_stage.append((*t[:5], {**t[5], "activations": acts}))
        times = [r[0] + r[1] + r[2] for r in per_stage]
        if c.schedule == "gems" and p > 1:
            per_stage, times = self._gems(c, stages, per_stage, times, stride_pp, g)
        j = max(range(p), key=lambda k: times[k])
        bubble = sum(times) - times[j] if p > 1 else 0.0
        if c.schedule == "gems" and p > 1:  # (G1) the schedule's counted idle share of the step
            frac = gems_bubble_fraction(p, m)
            bubble = m * times[j] * frac / (1 - frac)
        dp_t = max(r[3] for r in per_stage)
        opt_t = max(r[4] for r in per_stage)
        step = m * times[j] + bubble + dp_t + opt_t
        peaks = [sum(r[5].values()) for r in per_stage]
        worst = max(range(p), key=lambda k: peaks[k])
        return Estimate(
            candidate=c,
            step_s=step,
            compute_s=m * per_stage[j][0],
            tp_comm_s=m * per_stage[j][1],
            p2p_s=m * per_stage[j][2],
            bubble_s=bubble,
            dp_comm_s=dp_t,
            optimizer_s=opt_t,
            memory_bytes=peaks[worst],
            memory=dict(per_stage[worst][5]),
            fits=peaks[worst] <= cl.memory_bytes,
            micro_batch=int(b),
            stage_layers=tuple(self.split(c.pp)),
            samples_per_s=wl.batch / step if step > 0 else math.inf,
        )

    def _spatial(self, c: Candidate) -> Estimate:
        """dp x sp (S1-S4): each replica's samples split in `sp` slabs along the height (SpatialParallel).

        S1: the spatial layers' FLOPs (or timed per-sample seconds) divide by sp, the replicated head's do
        not; the per-layer and per-operator overheads do not shrink. S2: every spatial layer exchanges its
        halo rows with each neighbour (one for sp = 2, two inside) in forward and its gradients in backward,
        hidden behind the interior computation for the cluster's overlap share. S3: the weights are
        replicated over dp x sp, whose gradients are reduced together (D1). S4: activations per device are
        1/sp of the spatial layers' plus the halos received (`spatial_activation_bytes`) plus the head's.
        """
        cl, wl = self.cluster, self.workload
        b = wl.batch / c.dp
        whole = self.stages(1, 1)[0]
        layers = self.profile.layers
        spatial = [ly for ly in layers if ly.spatial]
        head = [ly for ly in layers if not ly.spatial]
        rate = self.rate(c)
        share = cl.sharing(self.busy(c))  # devices per core: the CPU's fixed costs and copies slow down alike
        if self.measured:
            slowdown = cl.rate(wl.compute_dtype) / rate
            per_sample = sum(ly.fwd_per_sample_s for ly in spatial) / c.sp + sum(ly.fwd_per_sample_s for ly in head)
            fwd = (whole.fwd_fixed_s + per_sample * b) * slowdown
            bwd = self.profile.backward_ratio * fwd
            interior = (sum(ly.fwd_per_sample_s for ly in spatial) / c.sp) * b * slowdown
            interior *= 1 + self.profile.backward_ratio
        else:
            flops = sum(ly.flops for ly in spatial) / c.sp + sum(ly.flops for ly in head)
            fwd = flops * b / rate + (whole.layers * cl.layer_overhead_s + whole.ops * cl.op_overhead_s) * share
            bwd = 2 * fwd
            interior = 3 * sum(ly.flops for ly in spatial) / c.sp * b / rate
        bwd += cl.pass_overhead_s * share
        # S2: halos, forward and backward, to one neighbour (sp = 2) or two; consecutive ranks, one node if they fit
        link = cl.intra if c.sp <= cl.devices_per_node else cl.inter
        neighbours = 1 if c.sp == 2 else 2
        halo_total = 0.0
        for ly in spatial:
            if ly.halo_messages:
                one = coll.p2p(link, ly.halo_bytes * b / ly.halo_messages)
                halo_total += 2 * neighbours * ly.halo_messages * one
        halo_t = max(halo_total * share - cl.overlap * interior, 0.0)
        # S3: the gradients of the replicated weights, reduced over dp x sp (as data parallelism's D1)
        replicas = replace(c, dp=c.dp * c.sp, sp=1)
        bucket = wl.bucket_mb * 1e6
        dp_t = self._dp_exposed(replicas, whole, coll.group(cl, c.dp * c.sp, 1), bucket, 1, fwd, bwd) * share
        opt_t = self._optimizer_s(whole, 1) * share
        mem, _, _ = self._memory(replicas, whole, 1, b, False, bucket)
        # S4: the busiest (interior) slab receives a halo from each neighbour
        received = neighbours * sum(ly.halo_bytes for ly in spatial) * b
        mem["activations"] = spatial_activation_bytes(
            b * sum(ly.activation_bytes for ly in spatial), c.sp, received
        ) + b * sum(ly.activation_bytes for ly in head)
        peak = sum(mem.values())
        step = fwd + bwd + halo_t + dp_t + opt_t
        return Estimate(
            candidate=c,
            step_s=step,
            compute_s=fwd + bwd,
            tp_comm_s=0.0,
            p2p_s=0.0,
            bubble_s=0.0,
            dp_comm_s=dp_t,
            optimizer_s=opt_t,
            memory_bytes=peak,
            memory=mem,
            fits=peak <= cl.memory_bytes,
            micro_batch=int(b),
            stage_layers=(len(layers),),
            samples_per_s=wl.batch / step if step > 0 else math.inf,
            halo_s=halo_t,
        )

    def _gems(self, c: Candidate, stages: list, per_stage: list, times: list, stride: int, g: int) -> tuple:
        """GEMS-MASTER (G1-G3): device i runs stage i and stage p-1-i on half the micro-batches each.

        G1: time per micro-batch slot = the mean of its two stages'. G2: model
        states of both stages; activations: the schedule's peak on this device
        (both replicas) x the larger of the two stages' share per micro-batch.
        G3: the mirrored copy's gradients go to the partner device once per
        step (counted as exposed), and the optimizer updates both copies.
        """
        p = len(per_stage)
        out, slots = [], []
        for i in range(p):
            mine, mirror = per_stage[i], per_stage[p - 1 - i]
            slots.append((times[i] + times[p - 1 - i]) / 2)
            mem = {k: mine[5][k] + (mirror[5][k] if i != p - 1 - i else mine[5][k]) for k in mine[5]}
            # activations: each entry already counts this device's peak of the gems schedule (both replicas)
            mem["activations"] = max(mine[5]["activations"], mirror[5]["activations"])
            grads = stages[p - 1 - i].params * self.bytes.grad
            same_node = (i * stride) // g == ((p - 1 - i) * stride) // g
            link = self.cluster.intra if same_node else self.cluster.inter
            exchange = coll.p2p(link, grads) if i != p - 1 - i else 0.0
            out.append((*mine[:3], mine[3] + exchange, mine[4] + mirror[4], mem))
        return out, slots

    def _stage(
        self,
        c: Candidate,
        s: _Stage,
        b: float,
        recomputes: bool,
        link_out: Any,
        link_in: Any,
        p: int,
    ) -> tuple[float, float, float, float, float, dict[str, float], float, float]:
        """(compute, tp, p2p) per micro-batch, exposed dp communication, optimizer time, memory of one stage."""
        cl = self.cluster
        rate = self.rate(c)
        share = cl.sharing(self.busy(c))  # devices per core (C3): the CPU's fixed costs and copies slow down alike
        # Compute (C1): F = FLOPs / rate + fixed overhead per layer and per operator; backward 2x, recompute 1x.
        if self.measured:
            # (C1'): the layers' timed forward on one thread of this machine, slowed by ranks sharing its cores.
            slowdown = cl.rate(self.workload.compute_dtype) / rate
            fwd = (s.fwd_fixed_s + s.fwd_per_sample_s * b) * slowdown
            bwd = self.profile.backward_ratio * fwd
        else:
            fwd = s.flops * b / rate + (s.layers * cl.layer_overhead_s + s.ops * cl.op_overhead_s) * share
            bwd = 2 * fwd
        rc = fwd if recomputes else 0.0
        bwd += cl.pass_overhead_s * share  # (C2) once per forward-backward pass of a micro-batch
        # Tensor parallelism (T1): each allreduce moves one layer output of the micro-batch.
        tp_t = 0.0
        if c.tp > 1:
            tp_group = coll.group(cl, c.tp, 1)
            fwd_count = s.tp_fwd_count * (2 if recomputes else 1)
            fwd_bytes = s.tp_fwd_bytes * (2 if recomputes else 1)
            for count, nbytes in ((fwd_count, fwd_bytes), (s.tp_bwd_count, s.tp_bwd_bytes)):
                if count:
                    tp_t += count * coll.allreduce(cl, tp_group, nbytes * b / count)
        # Pipeline sends (P1): activation forward to stage i+1, gradient backward to stage i-1.
        p2p_t = 0.0
        if link_out is not None:
            p2p_t += coll.p2p(link_out, s.out_bytes * b)
        if link_in is not None:
            p2p_t += coll.p2p(link_in, s.in_bytes * b)
        # Data parallel and ZeRO (D1-D4), exposed beyond what backward hides.
        dp_group = coll.group(cl, c.dp, c.tp)
        bucket = self.workload.bucket_mb * 1e6
        dp_t = self._dp_exposed(c, s, dp_group, bucket, c.micro_batches, fwd, bwd + rc)
        opt_t = self._optimizer_s(s, c.dp if c.zero >= 1 else 1)
        mem, per_alive, fixed = self._memory(c, s, p, b, recomputes, bucket)
        return fwd + bwd + rc, tp_t * share, p2p_t * share, dp_t * share, opt_t * share, mem, per_alive, fixed

    def _optimizer_s(self, s: _Stage, shards: int) -> float:
        """Optimizer step (O1): memory-bound over the parameters this device updates (1/shards of the stage's),
        plus a fixed cost per tensor; a calibrated cluster's measured nanoseconds per parameter where given."""
        cl = self.cluster
        measured_ns = (cl.optimizer_ns or {}).get(self.workload.optimizer.replace("adamw", "adam"))
        if measured_ns is not None:
            seconds = s.params / shards * measured_ns * 1e-9
        else:
            seconds = s.params / shards * self.traffic / cl.memory_bandwidth_Bps
        return seconds + math.ceil(s.tensors / shards) * cl.tensor_overhead_s

    def _zero3_units(self, s: _Stage) -> int:
        """ZeRO-3 gathers a unit of at least `bucket_mb` of parameters at a time (hpdl's size-based wrap
        policy), at most one per layer."""
        bucket = self.workload.bucket_mb * 1e6
        return max(1, min(s.layers, int(s.params * self.bytes.param // bucket)))

    def _pp_link(self, stage: int, stride: int, per_node: int) -> Any:
        """The link between stage `stage` and `stage + 1`: inter-node when their first ranks sit on two nodes."""
        same = (stage * stride) // per_node == ((stage + 1) * stride) // per_node
        return self.cluster.intra if same else self.cluster.inter

    def _dp_exposed(
        self, c: Candidate, s: _Stage, group: coll.Group, bucket: float, m: int, fwd: float, bwd: float
    ) -> float:
        if c.dp <= 1:
            return 0.0
        cl = self.cluster
        grads = s.params * self.bytes.grad
        weights = s.params * self.bytes.param
        hide = cl.overlap * bwd
        if c.zero == 3:
            # D4: ZeRO-3 over the stage's dp group (each tp slice sharded over it), one unit at a time, prefetched
            # (hpdl.parallel.zero_redundancy.hybrid_cost): resharding gathers every unit for each micro-batch's
            # forward and backward (2 m u all-gathers), keeping gathers it once per step (u); gradients are
            # reduce-scattered once per step, in the last micro-batch's backward (the pipeline's others run in
            # no_sync), u of them. The m forwards and backwards hide all gathers but those that nothing precedes:
            # the first unit of the step (and of every micro-batch when resharding); the reduce-scatters hide
            # behind the last backward only, as ZeRO-2's (D3), all but the last unit's.
            from hpdl.parallel.zero_redundancy.hybrid_cost import stage3_traffic  # lazy: loads torch (~0.4 s)

            units = self._zero3_units(s)
            traffic = stage3_traffic(s.params, units, m, reshard_after_forward=c.reshard,
                                     param_bytes=self.bytes.param, grad_bytes=self.bytes.grad)  # fmt: skip
            gather = coll.allgather(cl, group, traffic.allgather_bytes)
            scatter = coll.reduce_scatter(cl, group, traffic.reduce_scatter_bytes)
            gathers = max(traffic.allgathers * gather - cl.overlap * m * (fwd + bwd), traffic.exposed_gathers * gather)
            return gathers + max(traffic.reduce_scatters * scatter - hide, scatter)
        buckets = max(1, math.ceil(grads / bucket))
        if c.zero == 2:
            # D3: bucketed reduce-scatter in backward, once per step (a pipeline accumulates its micro-batches
            # first), then an allgather of the updated parameters after the step.
            one = coll.reduce_scatter(cl, group, grads / buckets)
            after = coll.allgather(cl, group, weights)
        else:
            # D1 (z0) and D2 (z1): bucketed allreduce in backward; ZeRO-1 then gathers the updated parameters.
            one = coll.allreduce(cl, group, grads / buckets)
            after = coll.allgather(cl, group, weights) if c.zero == 1 else 0.0
        total = buckets * one
        return max(total - hide, one) + after

    def _memory(
        self, c: Candidate, s: _Stage, p: int, b: float, recomputes: bool, bucket: float
    ) -> tuple[dict[str, float], float, float]:
        """Model states and buffers, and activations as (bytes per alive micro-batch, fixed bytes)."""
        from hpdl.parallel.zero_redundancy import memory_formula  # lazy: start-up time, as above
        from hpdl.parallel.zero_redundancy.hybrid_cost import stage3_memory

        wl, cl = self.workload, self.cluster
        # M1: model states as hpdl's ZeRO keeps them (hpdl.parallel.zero_redundancy.memory_formula): in mixed
        # precision the gradient shards of stages 2 and 3 are fp32, and at stage 3 the fp32 master shard is the
        # parameter (the paper's 16 Psi / N total at stage 3 is unchanged).
        mixed = wl.precision == "mixed"
        states = memory_formula(
            c.zero,
            s.params,  # a real count: tensor parallelism divides it
            c.dp,
            param_bytes=self.bytes.param,
            state_bytes=self.bytes.optimizer - (4 if mixed else 0),  # the formula adds the fp32 master copy
            mixed_precision=mixed,
        )
        # M2: activations = alive x per-micro-batch bytes, alive = GPipe m, 1F1B min(p - i, m); no pipeline: 1.
        if recomputes:
            # M3: only each layer's input is kept; one layer's activations live while it recomputes.
            per_alive, fixed = b * s.checkpoint, b * s.largest_activation
        else:
            per_alive, fixed = b * s.activations, 0.0
        grads, params = states["grads"], states["params"]
        if c.zero == 3:
            # M1'': ZeRO-3 in a hybrid layout (hybrid_cost.stage3_memory): the shards of the stage's (tp-divided)
            # parameters, plus the gathered units (the largest and its prefetched neighbour when resharding, the
            # whole stage when kept); with micro-batches the stage's full gradient accumulates until the step's
            # reduce-scatter. Buffers: one gradient bucket.
            units = self._zero3_units(s)
            unit = max(s.largest_params, s.params / units)
            z3 = stage3_memory(
                s.params,
                c.dp,
                micro_batches=c.micro_batches,
                largest_unit_numel=unit,
                second_unit_numel=unit if units > 1 else 0.0,  # a stage of one unit has none to prefetch
                reshard_after_forward=c.reshard,
                param_bytes=self.bytes.param,
                state_bytes=self.bytes.optimizer - (4 if mixed else 0),
                mixed_precision=mixed,
            )
            grads, params = z3["grads"], z3["params"]
            buffers = min(bucket, s.params * self.bytes.grad)
        elif c.dp > 1:
            buffers = min(2 * bucket, s.params * self.bytes.grad)
        else:
            buffers = 0.0
        if c.zero == 2 and p > 1:
            # M1': with a pipeline, ZeRO-2 accumulates the micro-batches' gradients in full, then reduce-scatters.
            grads = s.params * self.bytes.grad
        memory = {
            "params": params,
            "grads": grads,
            "optimizer": states["optimizer"],
            "activations": 0.0,
            "buffers": buffers,
            "reserved": cl.reserved_bytes,
        }
        return memory, per_alive, fixed


def explain_breakdown(e: Estimate) -> dict[str, float]:
    """The parts of the step time, which sum to `step_s`."""
    return {
        "compute": e.compute_s,
        "tp": e.tp_comm_s,
        "p2p": e.p2p_s,
        "bubble": e.bubble_s,
        "dp": e.dp_comm_s,
        "optimizer": e.optimizer_s,
        "halo": e.halo_s,
    }
