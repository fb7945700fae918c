"""The planner's formulas and search, in one process: textbook figures, alpha-beta behaviour, known answers."""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction

import pytest
import torch

from hpdl.parallel import Plan
from hpdl.plan import collectives as coll
from hpdl.plan.calibrate import fit_alpha_beta
from hpdl.plan.cluster import GB, Cluster, ClusterError, Link, load_cluster_file
from hpdl.plan.cost import Candidate, CostModel, Workload, balance
from hpdl.plan.memory import bubble_fraction, in_flight, model_states
from hpdl.plan.models import SHAPES, reference_profile, transformer_profile
from hpdl.plan.presets import parse_cluster, preset_cluster
from hpdl.plan.profile import Layer, ModelProfile, measure
from hpdl.plan.ranking import candidates, search
from hpdl.plan.report import fmt_gb, why


def uniform(layers: int, flops: float = 1e9, params: int = 1000, act: float = 1e3, out: float = 100.0) -> ModelProfile:
    """A model of identical layers (no tensor parallelism): stages balance exactly."""
    layer = Layer("layer", params=params, flops=flops, activation_bytes=act, output_bytes=out)
    return ModelProfile("uniform", tuple(replace(layer, name=f"l{i}") for i in range(layers)), act_dtype_bytes=4)


def toy_cluster(**changes) -> Cluster:
    base = Cluster(
        name="toy",
        nodes=1,
        devices_per_node=8,
        memory_bytes=80 * GB,
        flops={"fp32": 1e12},
        intra=Link("fast", 1e-6, 100 * GB),
        inter=Link("slow", 10e-6, 10 * GB),
        memory_bandwidth_Bps=1e12,
    )
    return replace(base, **changes)


# --------------------------------------------------------------------------- memory formulas
def test_zero_paper_figures_are_exact():
    """Rajbhandari et al. 2020, Figure 1: Psi = 7.5e9, N = 64, mixed-precision Adam (K = 12)."""
    totals = [model_states(7.5e9, 64, stage, "adam", "mixed").total for stage in range(4)]
    assert totals == [120e9, 31.40625e9, 16.640625e9, 1.875e9]
    assert [fmt_gb(t) for t in totals] == ["120.0", "31.4", "16.6", "1.875"]
    assert model_states(1e9, 8, 0, "adam", "fp32").total == 16e9  # fp32 Adam: 4 + 4 + 8 bytes
    with pytest.raises(ValueError, match="ZeRO stage"):
        model_states(1e9, 8, 4)
    with pytest.raises(ValueError, match="optimizer"):
        model_states(1e9, 8, 1, optimizer="lion")


def test_gpipe_bubble_formula_exact_in_the_formula_and_in_the_cost_model():
    assert bubble_fraction(4, 8) == Fraction(3, 11)
    assert bubble_fraction(1, 5) == 0
    assert in_flight("gpipe", 4, 8) == 8 and in_flight("1f1b", 4, 8) == 4 and in_flight("1f1b", 4, 8, 3) == 1
    # Equal stages and no communication cost: the predicted idle share is (p-1)/(m+p-1).
    cluster = toy_cluster(intra=Link("free", 0.0, 1e30), inter=Link("free", 0.0, 1e30))
    model = CostModel(uniform(8), cluster, Workload(batch=64, precision="fp32"))
    for p, m in ((2, 4), (4, 8), (8, 8), (4, 1)):
        e = model.estimate(Candidate(dp=1, pp=p, tp=1, zero=0, micro_batches=m, schedule="gpipe"))
        pipelined = e.step_s - e.optimizer_s
        assert e.bubble_s / pipelined == pytest.approx(float(bubble_fraction(p, m)), rel=1e-12)


def test_1f1b_holds_fewer_activations_than_gpipe():
    model = CostModel(uniform(8, act=1e9), toy_cluster(), Workload(batch=64, precision="fp32"))
    gpipe = model.estimate(Candidate(1, 4, 1, 0, 16, "gpipe"))
    ofob = model.estimate(Candidate(1, 4, 1, 0, 16, "1f1b"))
    assert gpipe.step_s == pytest.approx(ofob.step_s)
    assert gpipe.memory["activations"] == pytest.approx(4 * ofob.memory["activations"])  # m=16 vs p=4 alive
    recomputed = model.estimate(Candidate(1, 4, 1, 0, 16, "1f1b", "always"))
    assert recomputed.memory["activations"] < ofob.memory["activations"]
    assert recomputed.compute_s == pytest.approx(ofob.compute_s * 4 / 3)  # one more forward: 4F instead of 3F


# --------------------------------------------------------------------------- alpha-beta
def test_ring_allreduce_is_flat_in_n_for_large_messages_and_latency_grows():
    link = Link("l", 5e-6, 10 * GB)
    big = 1 << 30
    times = [coll.ring_allreduce(n, big, link) for n in (2, 4, 16, 64, 256)]
    assert all(a < b for a, b in zip(times, times[1:]))  # (n-1)/n rises ...
    assert times[-1] / times[1] < 1.4  # ... but towards 2 S / B: nearly flat
    assert times[-1] == pytest.approx(2 * big / link.bandwidth_Bps, rel=0.01)
    small = [coll.ring_allreduce(n, 8, link) for n in (2, 4, 16, 64)]
    assert small[-1] / small[0] == pytest.approx(63, rel=0.01)  # 2 (n-1) alpha: linear in n
    assert coll.tree_allreduce(64, 8, link) < small[-1]  # trees win for latency-bound messages at scale
    assert coll.p2p(link, 1e6) == pytest.approx(5e-6 + 1e6 / link.bandwidth_Bps)


def test_groups_that_span_nodes_pay_the_slower_link():
    cluster = toy_cluster(nodes=4)
    inside = coll.allreduce(cluster, coll.group(cluster, 8, 1), 1e9)
    across = coll.allreduce(cluster, coll.group(cluster, 8, 8), 1e9)  # one rank per node
    hier = coll.allreduce(cluster, coll.group(cluster, 32, 1), 1e9)  # 8 per node on 4 nodes
    assert inside < hier < across
    assert coll.group(cluster, 32, 1) == coll.Group(32, 8)
    assert coll.group(cluster, 4, 8).nodes == 4


def test_fit_alpha_beta_recovers_the_link():
    alpha, bandwidth = 7e-6, 3e9
    points = [(s, 2 * alpha + s / bandwidth) for s in (4, 4096, 1 << 16, 1 << 20, 1 << 22)]
    link = fit_alpha_beta(points, latency_factor=2, bandwidth_factor=1)
    assert link.latency_s == pytest.approx(alpha, rel=1e-6)
    assert link.bandwidth_Bps == pytest.approx(bandwidth, rel=1e-6)


def test_megatron_tensor_parallel_traffic_is_four_allreduces_of_bsh_per_layer():
    shape = replace(SHAPES["gpt2"], layers=4)
    profile = transformer_profile(shape, act_bytes=2)
    cluster = toy_cluster()
    wl = Workload(batch=8, precision="mixed")
    e = CostModel(profile, cluster, wl).estimate(Candidate(dp=1, pp=1, tp=2, zero=1))
    b, s, h = 8, shape.seq, shape.hidden
    one = coll.allreduce(cluster, coll.Group(2, 2), b * s * h * 2)
    extra = (
        coll.allreduce(cluster, coll.Group(2, 2), b * s * h * 2) * 1  # embedding (vocab-parallel): 1 forward
        + coll.allreduce(cluster, coll.Group(2, 2), b * s * 4) * 1  # head: 1 backward of its small output
    )
    assert e.tp_comm_s == pytest.approx(4 * 4 * one + extra, rel=1e-9)


# --------------------------------------------------------------------------- clusters
def test_cluster_inline_presets_and_toml_round_trip(tmp_path):
    c = parse_cluster("nodes=128,gpus_per_node=8,gpu=h100,intra=nvlink,inter=ib-200")
    assert (c.nodes, c.devices_per_node, c.devices) == (128, 8, 1024)
    assert c.memory_bytes == 80 * GB and c.intra.name == "nvlink4" and c.inter.bandwidth_Bps == 25 * GB
    assert "datasheet" in c.source
    assert parse_cluster("h200").memory_bytes == 141 * GB
    assert preset_cluster("a100-40", intra="nvlink").intra.name == "nvlink3"
    path = tmp_path / "cluster.toml"
    c.write(str(path))
    again = load_cluster_file(str(path))
    assert again.to_dict() == c.to_dict()
    path.write_text(path.read_text() + "\nbogus = 1\n")
    with pytest.raises(ClusterError, match="unknown keys.*bogus"):
        load_cluster_file(str(path))
    with pytest.raises(ClusterError, match="unknown gpu"):
        parse_cluster("gpu=tpu9")
    with pytest.raises(ClusterError, match="inline keys"):
        parse_cluster("gpu=h100,speed=fast")


# --------------------------------------------------------------------------- profiles
def test_reference_models_have_their_published_sizes():
    assert reference_profile("gpt2").params == 124_439_808
    assert reference_profile("llama-7b").params == 6_738_415_616
    assert reference_profile("gpt2-xl").params == pytest.approx(1.558e9, rel=1e-3)
    resnet = reference_profile("resnet50", act_bytes=4)
    assert resnet.params == 25_557_032
    assert resnet.flops == pytest.approx(2 * 4.09e9, rel=0.01)  # 4.1 GMACs at 224x224


def test_measured_gpt_block_matches_the_analytic_formula_on_cpu_and_meta():
    from hpdl.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)
    model = GPT(cfg)
    real = measure(model, lambda b: torch.randint(0, 64, (b, 32)))
    with torch.device("meta"):
        meta_model = GPT(cfg)
    meta = measure(meta_model, lambda b: torch.randint(0, 64, (b, 32)))
    s, h = 32, 64
    block = real.layers[1]
    assert block.name == "block0"
    assert block.flops == 2 * 12 * h * h * s + 4 * s * s * h  # Linear FLOPs + attention scores/sums
    assert [ly.flops for ly in meta.layers] == [ly.flops for ly in real.layers]
    assert real.params == sum(p.numel() for p in model.parameters())
    assert (block.tp_allreduce_fwd, block.tp_allreduce_bwd, block.tp_max) == (2, 2, 4)
    # Saved activations: every block saves the same, and at least its input and the attention matrix.
    assert real.layers[1].activation_bytes == real.layers[2].activation_bytes >= 4 * (s * h + 4 * s * s)


# --------------------------------------------------------------------------- search
def test_balance_minimises_the_slowest_stage():
    assert balance([1, 1, 1, 1, 4], 2) == [4, 1]
    assert balance([1.0] * 8, 4) == [2, 2, 2, 2]
    assert sum(balance([3, 1, 4, 1, 5, 9, 2, 6], 5)) == 8 and len(balance([3, 1, 4, 1, 5, 9, 2, 6], 5)) == 5
    with pytest.raises(ValueError):
        balance([1, 2], 3)


def test_tiny_model_on_a_fast_network_picks_pure_data_parallelism():
    result = search(uniform(8, flops=1e8, params=10_000), toy_cluster(), Workload(batch=256, precision="fp32"))
    best = result.best.candidate
    assert (best.dp, best.pp, best.tp) == (8, 1, 1)  # the ZeRO stage hardly matters for a tiny model
    assert "Best: dp8 x pp1 x tp1" in why(result)


def test_a_model_that_does_not_fit_gets_sharded_and_infeasible_plans_are_never_chosen():
    cluster = preset_cluster("a100-40", nodes=1, devices_per_node=8)
    result = search(reference_profile("llama-7b", seq=1024), cluster, Workload(batch=64))
    assert result.best is not None
    assert all(e.memory_bytes <= cluster.memory_bytes for e in result.feasible)
    unfit = [e for e in result.estimates if not e.fits]
    assert unfit and all(e.memory_bytes > cluster.memory_bytes for e in unfit)
    # 16 bytes x 6.7e9 parameters = 108 GB: replicated optimizer state cannot fit in 40 GB.
    plain = [e for e in result.estimates if e.candidate.pp == 1 and e.candidate.tp == 1 and e.candidate.zero < 2]
    assert plain and not any(e.fits for e in plain)
    best = result.best.candidate
    assert best.zero == 3 or best.pp > 1 or best.tp > 1


def test_candidates_respect_what_hpdl_parallel_plan_accepts():
    profile, cluster = reference_profile("gpt2"), toy_cluster()
    for c in candidates(profile, cluster, Workload(batch=64, precision="mixed")):
        assert c.dp * c.pp * c.tp == 8 and 64 % c.dp == 0 and 12 % c.tp == 0
        assert c.zero >= 1  # mixed precision lives in the ZeRO optimizer
        assert c.reshard or (c.zero == 3 and c.pp > 1 and c.micro_batches > 1)  # keep: with micro-batches only
        if c.pp == 1:
            assert (c.micro_batches, c.recompute) == (1, "never")
        elif c.schedule == "1f1b":
            assert c.micro_batches >= c.pp


def test_zero3_and_zero2_compose_with_pipelines_and_tensor_parallelism_in_the_search():
    found = list(candidates(reference_profile("gpt2"), toy_cluster(), Workload(batch=64, precision="mixed")))
    z3 = [c for c in found if c.zero == 3]
    assert any(c.pp > 1 and c.tp > 1 and c.dp > 1 for c in z3)  # dp x pp x tp, parameters sharded over dp
    assert any(c.pp > 1 and not c.reshard for c in z3) and any(c.pp > 1 and c.reshard for c in z3)
    assert any(c.zero == 2 and c.pp > 1 and c.tp > 1 for c in found)


@pytest.mark.parametrize("reshard", [True, False])
def test_zero3_in_a_hybrid_layout_costs_what_hybrid_cost_says(reshard):
    """D4 and M1'' are `hpdl.parallel.zero_redundancy.hybrid_cost`: per stage (dp2 x pp2 here), 2 m u all-gathers
    when resharding and u when kept, u reduce-scatters once per step; the full accumulated stage gradient."""
    from hpdl.parallel.zero_redundancy.hybrid_cost import stage3_memory, stage3_traffic

    cluster, wl = toy_cluster(overlap=0.0), Workload(batch=64, precision="fp32", bucket_mb=25)
    model = CostModel(uniform(8, flops=1e6, params=10_000_000), cluster, wl)
    c = Candidate(dp=2, pp=2, tp=1, zero=3, micro_batches=4, schedule="1f1b", reshard=reshard)
    e = model.estimate(c)
    stage, units = 40_000_000, 4  # 4 layers of 10M fp32 parameters per stage: 160 MB, units of >= 25 MB, <= a layer
    traffic = stage3_traffic(stage, units, 4, reshard_after_forward=reshard)
    assert traffic.allgathers == (2 * 4 * units if reshard else units) and traffic.reduce_scatters == units
    group = coll.group(cluster, 2, 1)
    want_s = traffic.allgathers * coll.allgather(cluster, group, traffic.allgather_bytes) + units * coll.reduce_scatter(
        cluster, group, traffic.reduce_scatter_bytes
    )
    assert e.dp_comm_s == pytest.approx(want_s)  # nothing hidden at overlap 0
    want = stage3_memory(stage, 2, micro_batches=4, largest_unit_numel=10e6, second_unit_numel=10e6,
                         reshard_after_forward=reshard)  # fmt: skip
    for part in ("params", "grads", "optimizer"):
        assert e.memory[part] == pytest.approx(want[part]), part
    assert e.memory["grads"] == pytest.approx(4 * stage + 4 * stage / 2)  # full accumulated gradient + its shard
    kept, resharded = (e, model.estimate(replace(c, reshard=True))) if not reshard else (None, e)
    if kept is not None:  # keeping: fewer all-gathers, the stage's whole parameters held
        assert kept.dp_comm_s < resharded.dp_comm_s and kept.memory["params"] > resharded.memory["params"]
    # with full overlap only the gathers that nothing precedes show (one per micro-batch when resharding), and
    # the last unit's reduce-scatter (they run in the last micro-batch's backward)
    hidden = CostModel(uniform(8, flops=1e12, params=10_000_000), toy_cluster(overlap=1.0), wl).estimate(c)
    one = coll.allgather(cluster, group, traffic.allgather_bytes)
    last = coll.reduce_scatter(cluster, group, traffic.reduce_scatter_bytes)
    assert hidden.dp_comm_s == pytest.approx(traffic.exposed_gathers * one + last)


def test_zero3_with_tensor_parallelism_shards_each_tp_slice_over_dp():
    from hpdl.parallel.zero_redundancy.hybrid_cost import stage3_memory

    profile, wl = reference_profile("gpt2"), Workload(batch=16, precision="fp32")
    model = CostModel(profile, toy_cluster(), wl)
    e = model.estimate(Candidate(dp=2, pp=1, tp=2, zero=3))
    stage = model.stages(1, 2)[0]
    assert stage.params < 0.6 * model.stages(1, 1)[0].params  # tp divides the stage (embeddings mostly split)
    units = model._zero3_units(stage)
    unit = max(stage.largest_params, stage.params / units)
    want = stage3_memory(stage.params, 2, largest_unit_numel=unit, second_unit_numel=unit if units > 1 else 0.0)
    for part in ("params", "grads", "optimizer"):
        assert e.memory[part] == pytest.approx(want[part]), part


def test_the_search_proposes_zero3_with_a_pipeline_for_a_model_that_only_fits_that_way(tmp_path):
    """2 layers of 50M fp32 parameters on 8 single-device nodes (no tp): dp4 x pp2 with ZeRO-3 (one micro-batch:
    no accumulated full gradient) needs 0.42 GB, ZeRO-2 with the pipeline 0.55 GB, dp8 with ZeRO-3 0.62 GB."""
    cluster = toy_cluster(nodes=8, devices_per_node=1, memory_bytes=0.45e9)
    result = search(uniform(2, params=50_000_000, act=1e3, out=1e2), cluster, Workload(batch=64, precision="fp32"))
    best = result.best.candidate
    assert (best.dp, best.pp, best.tp, best.zero) == (4, 2, 1, 3)
    assert result.estimates and all(e.candidate.zero == 3 and e.candidate.pp == 2 for e in result.feasible)
    assert not any(e.fits for e in result.estimates if e.candidate.zero == 2 and e.candidate.pp > 1)
    assert not any(e.fits for e in result.estimates if e.candidate.pp == 1)
    plan = result.best_plan()
    assert (plan.dp, plan.pp, plan.zero_stage, plan.reshard_after_forward) == (4, 2, 3, True)
    # a kept plan's reshard_after_forward travels through the plan file
    from hpdl.plan.ranking import plan_fields

    kept = Candidate(dp=4, pp=2, tp=1, zero=3, micro_batches=4, schedule="1f1b", reshard=False)
    fields = plan_fields(kept, result.workload, (1, 1))
    assert fields["reshard_after_forward"] is False and kept.label().endswith(" keep")
    path = Plan(**fields).to_file(str(tmp_path / "plan.toml"))
    assert Plan.from_file(path).reshard_after_forward is False


def test_plan_file_round_trip_through_hpdl_parallel_plan(tmp_path):
    from hpdl.parallel.mesh.plan_config import Plan

    cluster = preset_cluster("a100-40", nodes=2, devices_per_node=8)
    result = search(reference_profile("gpt2-xl"), cluster, Workload(batch=64))
    plan = result.best_plan()
    path = plan.to_file(str(tmp_path / "plan.toml"))
    loaded = Plan.from_file(path)
    assert loaded == plan
    c = result.best.candidate
    assert (loaded.dp, loaded.pp, loaded.tp, loaded.zero_stage) == (c.dp, c.pp, c.tp, c.zero)
    assert loaded.validate(world_size=16).degrees() == {"dp": c.dp, "pp": c.pp, "tp": c.tp, "sp": 1}


def test_a_1024_device_search_takes_seconds():
    cluster = parse_cluster("nodes=128,gpus_per_node=8,gpu=h100,intra=nvlink,inter=ib-400")
    result = search(reference_profile("llama-70b"), cluster, Workload(batch=1024))
    assert len(result.estimates) > 1000 and result.best is not None
    assert result.elapsed_s < 60  # loose: thousands per second on a quiet machine; this one is shared
    best = result.best.candidate
    assert best.tp > 1 and best.dp * best.pp * best.tp == 1024
    parts = result.best
    total = parts.compute_s + parts.tp_comm_s + parts.p2p_s + parts.bubble_s + parts.dp_comm_s + parts.optimizer_s
    assert total == pytest.approx(parts.step_s)
    assert math.isfinite(parts.samples_per_s)


def test_overlap_hides_gradient_communication_behind_backward():
    profile = uniform(4, flops=1e12, params=50_000_000)
    wl = Workload(batch=64, precision="fp32", bucket_mb=25)
    c = Candidate(dp=8, pp=1, tp=1, zero=0)
    hidden = CostModel(profile, toy_cluster(overlap=1.0), wl).estimate(c)
    exposed = CostModel(profile, toy_cluster(overlap=0.0), wl).estimate(c)
    grads = 4 * 50_000_000 * 4
    buckets = math.ceil(grads / 25e6)
    one = coll.allreduce(toy_cluster(), coll.Group(8, 8), grads / buckets)
    assert exposed.dp_comm_s == pytest.approx(buckets * one)
    assert hidden.dp_comm_s == pytest.approx(one)  # backward is long: only the last bucket shows


def test_devices_that_share_cores_slow_down_by_the_devices_per_core_that_compute_at_once(tmp_path):
    profile = uniform(4, flops=1e9, params=1_000_000)
    wl = Workload(batch=64, precision="fp32")
    alone = toy_cluster(devices_per_node=4, overlap=0.0, layer_overhead_s=1e-4, pass_overhead_s=1e-3,
                        tensor_overhead_s=1e-5)  # fmt: skip
    # 4 ranks on 2 cores (calibrate: every rank busy at once computes at half the rate of one alone)
    shared = replace(alone, node_flops={"fp32": 2e12}, cores_per_device=0.5)
    dp4 = Candidate(dp=4, pp=1, tp=1)
    a, s = CostModel(profile, alone, wl).estimate(dp4), CostModel(profile, shared, wl).estimate(dp4)
    for part in ("compute_s", "dp_comm_s", "optimizer_s", "step_s"):
        assert getattr(s, part) == pytest.approx(2 * getattr(a, part)), part
    dp2 = Candidate(dp=2, pp=1, tp=1)  # a core each: nothing shared
    assert CostModel(profile, shared, wl).estimate(dp2).step_s == pytest.approx(
        CostModel(profile, alone, wl).estimate(dp2).step_s
    )
    # the busy total of 4 oversubscribed ranks (context switches included) says nothing of 2 ranks on 2 cores
    lossy = replace(shared, node_flops={"fp32": 1.5e12})
    assert CostModel(profile, lossy, wl).estimate(dp2).step_s == pytest.approx(
        CostModel(profile, alone, wl).estimate(dp2).step_s
    )
    # a busy probe that saw more than a fair share of the cores (matmuls within a core's caches) counts as a fair one
    generous = replace(shared, node_flops={"fp32": 3e12})
    assert CostModel(profile, generous, wl).estimate(dp4).compute_s == pytest.approx(s.compute_s)
    # a pipeline's stages compute m / (m + p - 1) of the step: 4 x 4/7 ranks busy on 2 cores, 8/7 slower
    pp4 = Candidate(dp=1, pp=4, tp=1, micro_batches=4)
    assert CostModel(profile, shared, wl).busy(pp4) == pytest.approx(16 / 7)
    slow, fast = CostModel(profile, shared, wl).estimate(pp4), CostModel(profile, alone, wl).estimate(pp4)
    assert slow.compute_s == pytest.approx(8 / 7 * fast.compute_s)
    path = tmp_path / "cluster.toml"
    shared.write(str(path))
    assert load_cluster_file(str(path)).cores_per_device == 0.5
    assert shared.with_devices(1, 8).cores_per_device == 0.25  # the node's 2 cores, now for 8 devices
    with pytest.raises(ClusterError, match="cores_per_device"):
        replace(shared, cores_per_device=0.0)


def test_links_fitted_from_hpdl_bench_comm_records(tmp_path):
    """`hpdl plan calibrate --bench-json`: the records of `hpdl bench comm` (4 ranks here) give the link."""
    import json

    from hpdl.plan.calibrate import collectives_from_bench

    alpha, bandwidth, n = 20e-6, 2e9, 4
    records = [
        {"column": "hpdl-mpi", "op": "allreduce", "section": "ops", "ranks": n, "bytes": s,
         "median_us": 1e6 * (2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bandwidth)}
        for s in (4, 1 << 12, 1 << 16, 1 << 20, 1 << 24)
    ]  # fmt: skip
    records.append({"column": "mpi4py", "op": "allreduce", "section": "ops", "ranks": n, "bytes": 4, "median_us": 1})
    path = tmp_path / "comm.json"
    path.write_text(json.dumps(records))
    fitted = collectives_from_bench(str(path))
    assert fitted["ranks"] == n and fitted["p2p"] is None
    assert fitted["link"].latency_s == pytest.approx(alpha, rel=1e-6)
    assert fitted["link"].bandwidth_Bps == pytest.approx(bandwidth, rel=1e-6)


def test_search_memory_agrees_with_the_zero_implementation_formula():
    """The planner counts model states as hpdl.parallel.zero does (fp32 exactly the paper; mixed: fp32 shards)."""
    from hpdl.parallel.zero_redundancy import memory_formula

    params, dp = 4_000_000, 4
    profile = uniform(4, params=params // 4)
    for precision, kwargs in (("fp32", {}), ("mixed", {"param_bytes": 2, "mixed_precision": True})):
        model = CostModel(profile, toy_cluster(), Workload(batch=8, precision=precision))
        for stage in (1, 2, 3) if precision == "mixed" else (0, 1, 2, 3):
            e = model.estimate(Candidate(dp=dp, pp=1, tp=1, zero=stage))
            want = memory_formula(stage, params, dp, **kwargs)
            for part in ("params", "grads", "optimizer") if stage < 3 else ("grads", "optimizer"):
                assert e.memory[part] == pytest.approx(want[part]), (precision, stage, part)
            if stage == 3:  # the parameter shard, plus the gathered units (test_zero3_in_a_hybrid_layout_...)
                assert e.memory["params"] > want["params"]


def test_a_profile_is_timed_when_its_layers_have_any_measured_time():
    # On a busy machine every layer's slope over the two timed batches can come out zero; the fixed part
    # still says the layers were timed (CI once failed `hpdl plan validate --quick` on that).
    analytic = uniform(3)
    assert not analytic.timed
    flat = replace(analytic, layers=tuple(replace(ly, fwd_fixed_s=2e-5) for ly in analytic.layers))
    assert flat.timed
    CostModel(flat, toy_cluster(), Workload(batch=8, precision="fp32"), measured=True)
    with pytest.raises(ValueError, match="needs a profile with timed layers"):
        CostModel(analytic, toy_cluster(), Workload(batch=8, precision="fp32"), measured=True)


# --------------------------------------------------------------------------- spatial parallelism
def spatial_cnn(side: int = 64) -> tuple[torch.nn.Module, object]:
    """Convolutions (one strided, one dilated), batch norm and pooling, then a global pool and a linear head."""
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()),
        nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU()),
        nn.Sequential(nn.Conv2d(8, 16, 3, padding=2, dilation=2), nn.ReLU(), nn.MaxPool2d(2)),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    return net, lambda batch: torch.randn(batch, 3, side, side)


def test_a_cnn_profile_marks_the_layers_that_run_on_slabs_and_their_halos():
    from hpdl.parallel.spatial.cost import spatial_estimate

    net, example = spatial_cnn(64)
    profile = measure(net, example, batch=2)
    assert [layer.spatial for layer in profile.layers] == [True, True, True, False, False, False]
    # one halo row per boundary of each 3x3 conv (two for the dilated one), C x W x 4 bytes per row
    assert [layer.halo_bytes for layer in profile.layers[:3]] == [1 * 3 * 64 * 4, 1 * 8 * 64 * 4, 2 * 8 * 32 * 4]
    assert [layer.halo_messages for layer in profile.layers[:3]] == [1, 1, 1]
    inputs = [(1, 3, 64, 64), (1, 8, 64, 64), (1, 8, 32, 32)]
    for layer, unit, shape in zip(profile.layers, net, inputs):  # the windows SpatialParallel itself uses
        assert max(spatial_estimate(unit, shape, parts=2).halo_bytes_forward) == layer.halo_bytes
    assert profile.spatial_limit() == 16  # the pooled output of the last spatial layer has 16 rows
    mlp = measure(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), lambda b: torch.randn(b, 8))
    assert mlp.spatial_limit() == 0 and not any(layer.spatial for layer in mlp.layers)


def test_spatial_plans_split_activations_and_compute_and_win_when_a_sample_does_not_fit(tmp_path):
    from hpdl.cli.plan import write_plan

    net, example = spatial_cnn(256)
    profile = measure(net, example, batch=2)
    spatial = [layer for layer in profile.layers if layer.spatial]
    head = [layer for layer in profile.layers if not layer.spatial]
    whole = sum(layer.activation_bytes for layer in profile.layers)
    workload = Workload(batch=1, precision="fp32", optimizer="sgd")
    # a device holds 40% of one sample's activations: no data-parallel or pipeline plan can hold a sample
    cluster = toy_cluster(devices_per_node=4, memory_bytes=0.4 * whole, overlap=0.0)
    model = CostModel(profile, cluster, workload)
    e = model.estimate(Candidate(1, 1, 1, sp=4))
    halos = sum(layer.halo_bytes for layer in spatial)
    # S4: a quarter of the spatial layers' activations, the halos of two neighbours, and the whole head
    expected = sum(layer.activation_bytes for layer in spatial) / 4 + 2 * halos + sum(a.activation_bytes for a in head)
    assert e.memory["activations"] == pytest.approx(expected)
    # S1: the spatial layers' FLOPs divide by 4 (forward + 2x backward), the head's do not
    flops = sum(layer.flops for layer in spatial) / 4 + sum(layer.flops for layer in head)
    overheads = (
        len(profile.layers) * cluster.layer_overhead_s + sum(ly.ops for ly in profile.layers) * cluster.op_overhead_s
    )
    assert e.compute_s == pytest.approx(3 * (flops / 1e12 + overheads) + cluster.pass_overhead_s)
    # S2: with nothing hidden, each spatial conv sends its halo to two neighbours and gets the gradient back
    link = cluster.intra
    assert e.halo_s == pytest.approx(sum(4 * coll.p2p(link, ly.halo_bytes) for ly in spatial if ly.halo_messages))
    assert e.step_s == pytest.approx(e.compute_s + e.halo_s + e.dp_comm_s + e.optimizer_s) and e.dp_comm_s > 0
    hidden = CostModel(profile, replace(cluster, overlap=1.0), workload).estimate(Candidate(1, 1, 1, sp=4))
    assert hidden.halo_s == 0.0 and hidden.step_s < e.step_s

    result = search(profile, cluster, workload)
    assert result.best is not None and result.best.candidate == Candidate(1, 1, 1, sp=4)
    assert not any(x.fits for x in result.estimates if x.candidate.sp == 1)  # pipelines too: a stage holds too much
    assert {x.candidate.sp for x in result.estimates} == {1, 4}  # batch 1: dp must be 1, so sp is 1 (pp4) or 4
    data = result.to_dict()
    assert data["plan"]["sp"] == 4 and data["spatial"] == {"dp": 1, "sp": 4} and data["best"]["sp"] == 4
    assert "x sp4 (spatial" in why(result)
    written = Plan.from_file(write_plan(result, str(tmp_path / "plan.toml")))  # build() takes it as it is
    assert written == result.best_plan() and written.validate(4).degrees() == {"dp": 1, "pp": 1, "tp": 1, "sp": 4}


def test_spatial_candidates_stay_where_spatial_parallel_runs():
    net, example = spatial_cnn(64)
    profile = measure(net, example, batch=2)
    found = [c for c in candidates(profile, toy_cluster(), Workload(batch=4, precision="fp32")) if c.sp > 1]
    # 8 devices, batch 4: dp in {1, 2, 4} so sp in {8, 4, 2}; at most one row per slab of the 16-row layer
    assert sorted((c.dp, c.sp) for c in found) == [(1, 8), (2, 4), (4, 2)]
    assert all((c.pp, c.tp, c.zero, c.devices) == (1, 1, 0, 8) for c in found)
    assert not [
        c for c in candidates(profile, toy_cluster(), Workload(batch=4, precision="fp32"), spatial=False) if c.sp > 1
    ]
    gpt = reference_profile("gpt2")
    assert not [c for c in candidates(gpt, toy_cluster(), Workload(batch=64, precision="mixed")) if c.sp > 1]


def test_a_cnn_whose_activations_exceed_the_machine_is_profiled_on_the_meta_device(tmp_path):
    from hpdl.plan.profile import measure_factory

    source = tmp_path / "big_cnn.py"
    source.write_text(
        "import torch\n"
        "def make():\n"
        "    return torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),\n"
        "                               torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.AdaptiveAvgPool2d(1))\n"
        "def example_input(batch):\n"
        "    return torch.empty(batch, 3, 8192, 8192)\n"
    )
    profile = measure_factory(f"{source}:make")  # for real: 2 x 64 x 8192^2 x 4 B = 34 GB per saved tensor
    assert "meta device" in profile.source
    assert sum(layer.activation_bytes for layer in profile.layers) >= 64 * 8192 * 8192 * 4  # per sample
    assert [layer.spatial for layer in profile.layers] == [True, True, True, False]
