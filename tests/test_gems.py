"""GEMS-MASTER (`Pipeline(schedule="gems")`): two mirrored replicas on p ranks train exactly like one process.

Equivalence: float64 models, SGD with momentum, 5 steps, parameters of both
copies of every stage within 1e-10 of one process on the whole batch, on 1,
2, 3 and 4 ranks, with recomputation, measured balance, tuple stages,
gradients kept between steps (`zero_grad(set_to_none=False)`) and GEMS x
data parallelism (pp=1 x dp=2, pp=2 x dp=2); on MPI the copies' gradients
are summed in shared memory, on the torch backend sent as messages. The schedule's promises
are counted: the engine runs exactly `schedule.actions(rank)`, holds
`schedule.peak_live(rank)` micro-batches at its peak (2 on 2 ranks, at most
p + 1), and the grid's bubble is 0 on 2 ranks and below 1F1B's on 4.
"""

from __future__ import annotations

import time

import pytest
import torch

from hpdl.parallel import Pipeline
from hpdl.parallel.pipe.gems_schedule import GemsSchedule, gems_bubble, gems_peak_bound
from hpdl.parallel.pipe.schedule import bubble_fraction
from test_pipeline import STEPS, loss_fn, make_data, make_model, train_reference

TOL = 1e-10


def gems_train(comm, cfg: dict) -> dict:
    dp_size = cfg.get("dp", 1)
    pp_size = comm.size // dp_size
    replica, position = comm.rank // pp_size, comm.rank % pp_size
    pp = comm.split(replica, key=position) if dp_size > 1 else comm
    dp = comm.split(position, key=replica) if dp_size > 1 else None
    kind = cfg.get("model", "mlp")
    xs, ys = make_data(kind)
    if dp_size > 1:  # replica d trains on its slice of each batch
        rows = ys.shape[1] // dp_size
        part = slice(replica * rows, (replica + 1) * rows)
        xs = [tuple(t[part] for t in x) if isinstance(x, tuple) else x[part] for x in xs]
        ys = ys[:, part]
    sample = xs[0][:2] if cfg.get("balance") == "auto" else None
    pipe = Pipeline(make_model(kind), pp, chunks=cfg.get("chunks", 4), schedule="gems", data_parallel=dp,
                    checkpoint=cfg.get("checkpoint", "never"), balance=cfg.get("balance"), sample=sample)  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=cfg.get("set_to_none", True))
        loss = pipe.step(xs[s] if pipe.is_first else None, ys[s] if pipe.is_last else None, loss_fn)
        opt.step()
        losses.append(float(loss))
    copies = {}
    for name, layers, first in (
        ("A", pipe.layers, pipe.first_layer),
        ("B", pipe.mirror_layers, pipe.mirror_first_layer),
    ):
        for n, p in layers.named_parameters():
            index, rest = n.split(".", 1)
            copies[f"{name}:{first + int(index)}.{rest}"] = p.detach().clone()
    schedule = pipe.schedule(pipe.stats.microbatches)
    out = {
        "params": copies,
        "losses": losses,
        "peak_live": pipe.stats.peak_live,
        "planned_peak": schedule.peak_live(pp.rank),
        "ran_the_schedule": list(pipe.stats.actions) == schedule.actions(pp.rank),
        "stages": pp.size,
        "microbatches": pipe.stats.microbatches,
        "exchange": pipe.gradient_exchange,
    }
    pipe.close()
    for group in (pp, dp):
        if group is not None and group is not comm:
            group.close()
    return out


def train_many(comm, cfgs: list[dict]) -> list[dict]:
    return [gems_train(comm, cfg) for cfg in cfgs]


def check(results: list[list[dict]], cfgs: list[dict]) -> None:
    for index, cfg in enumerate(cfgs):
        want, want_losses = train_reference(cfg)
        seen = {"A": set(), "B": set()}
        for rank, per_rank in enumerate(results):
            got = per_rank[index]
            if cfg.get("dp", 1) == 1:  # with dp a replica returns the mean over its own rows
                assert got["losses"] == pytest.approx(want_losses, abs=TOL), (cfg, rank)
            for name, value in got["params"].items():
                copy, param = name.split(":")
                err = float((value - want[param]).abs().max())
                assert err <= TOL, f"{cfg} rank {rank} copy {name}: max |diff| {err:.3g}"
                seen[copy].add(param)
            # counted in the engine: the merged order, and the micro-batches held at the peak
            assert got["ran_the_schedule"], (cfg, rank)
            assert got["peak_live"] == got["planned_peak"] <= gems_peak_bound(got["stages"], got["microbatches"])
            if got["stages"] == 2:
                assert got["peak_live"] == 2, (cfg, rank, got["peak_live"])
        assert seen["A"] == seen["B"] == set(want), (cfg, seen)  # two copies of every parameter
        mean_loss = [sum(r[index]["losses"][s] for r in results) / len(results) for s in range(STEPS)]
        assert mean_loss == pytest.approx(want_losses, abs=TOL), cfg  # equal replicas: the mean of their means


ONE = [{}]
TWO = [{}, {"balance": "auto", "chunks": 8, "checkpoint": "always"},
       {"model": "tuple", "checkpoint": "except_last", "set_to_none": False}, {"dp": 2}]  # fmt: skip
THREE = [{"set_to_none": False}]  # the middle rank holds both copies of its stage
FOUR = [{"checkpoint": "always", "chunks": 8}, {"dp": 2, "balance": "auto", "checkpoint": "except_last"}]


@pytest.mark.parametrize(
    ("backend", "nprocs", "cfgs"),
    [("self", 1, ONE), ("mpi", 2, TWO), ("mpi", 3, THREE), ("mpi", 4, FOUR), ("torch", 2, ONE)],
    ids=["self-1", "mpi-2", "mpi-3", "mpi-4", "torch-2"],
)
def test_gems_trains_both_copies_like_one_process(ranks, backend, nprocs, cfgs):
    results = ranks(backend, nprocs).run(train_many, cfgs, timeout=120)
    check(results, cfgs)
    # partners on one node (MPI with shared memory) sum the copies' gradients in a shared window; else messages
    for per_rank in results:
        wanted = [
            "local" if got["stages"] == 1 else "shared memory" if backend == "mpi" else "messages" for got in per_rank
        ]
        assert [got["exchange"] for got in per_rank] == wanted


def unseeded_copies(comm) -> dict:
    factories = [lambda: torch.nn.Linear(4, 4).double() for _ in range(4)]
    with Pipeline(factories, comm, chunks=2, schedule="gems") as pipe:
        a = torch.cat([p.detach().reshape(-1) for p in pipe.layers.parameters()])
        b = torch.cat([p.detach().reshape(-1) for p in pipe.mirror_layers.parameters()])
    return {"A": a, "B": b}


def test_both_copies_of_a_stage_start_equal_even_from_unseeded_factories(ranks):
    got = ranks("mpi", 2).run(unseeded_copies, timeout=60)
    assert torch.equal(got[0]["A"], got[1]["B"]) and torch.equal(got[1]["A"], got[0]["B"])


def test_the_schedule_fills_one_replica_bubble_with_the_other():
    for m in (2, 4, 8, 16):
        schedule = GemsSchedule(2, m)
        assert schedule.bubble == gems_bubble(2, m) == 0.0  # 1F1B: 1 / (m + 1)
        assert [schedule.peak_live(r) for r in range(2)] == [2, 2] == [gems_peak_bound(2, m)] * 2
    for p, m in ((3, 6), (4, 8), (4, 16)):
        schedule = GemsSchedule(p, m)
        assert schedule.bubble < bubble_fraction(p, m), (p, m)
        assert max(schedule.peak_live(r) for r in range(p)) == gems_peak_bound(p, m), (p, m)
    drawing = GemsSchedule(2, 4).draw()
    assert "rank 0: F0 f0 b0 b0 B0 B0 F1 f1 b1 b1 B1 B1" in drawing, drawing
    assert "rank 1: f0 F0 B0 B0 b0 b0 f1 F1 B1 B1 b1 b1" in drawing, drawing


def test_gems_bad_arguments_say_what_to_do():
    from hpdl.comm.self_backend import SelfCommunicator

    comm = SelfCommunicator(timeout=5.0, debug=False)
    with pytest.raises(ValueError, match="even number"):
        Pipeline(make_model("mlp"), comm, schedule="gems", chunks=3)
    with pytest.raises(ValueError, match="no wrap_stage"):
        Pipeline(make_model("mlp"), comm, schedule="gems", wrap_stage=lambda m: m)


def test_the_planner_knows_the_gems_schedule():
    from hpdl.plan.cost import Candidate, CostModel, Workload
    from hpdl.plan.memory import gems_bubble_fraction, in_flight
    from hpdl.plan.models import reference_profile
    from hpdl.plan.presets import preset_cluster

    assert in_flight("gems", 2, 8, 0) == 2 and in_flight("gems", 4, 8, 1) == GemsSchedule(4, 8).peak_live(1)
    assert gems_bubble_fraction(2, 8) == 0.0 and gems_bubble_fraction(4, 8) == pytest.approx(5 / 29)
    model = CostModel(reference_profile("gpt2"), preset_cluster("a100", nodes=1, devices_per_node=8),
                      Workload(batch=64, precision="fp32"))  # fmt: skip
    gems, one = (model.estimate(Candidate(4, 2, 1, 0, 8, s, "never")) for s in ("gems", "1f1b"))
    assert gems.bubble_s == 0.0 < one.bubble_s  # 2 stages: GEMS fills the bubble
    # ... at the price of a second copy of every stage's model states on each device
    assert gems.memory["params"] == pytest.approx(2 * one.memory["params"], rel=0.2)


def gems_failing_step(comm, failing_rank: int) -> str:
    """The first layer of stage `failing_rank` of replica A (on that rank; the other ranks build their copies of
    the stage without it) raises in its 3rd forward: step 1's first (2 micro-batches a step in each replica)."""
    from test_pipeline import DIN, DOUT, Explode

    layers = [torch.nn.Linear(DIN, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, DOUT)]
    if comm.rank == failing_rank:
        first = failing_rank * len(layers) // comm.size  # (equal layer counts per stage)
        layers[first] = torch.nn.Sequential(Explode(3), layers[first])
    pipe = Pipeline(torch.nn.Sequential(*layers).double(), comm, chunks=4, schedule="gems")
    xs, ys = make_data("mlp")
    started = time.perf_counter()
    for s in range(3):
        pipe.step(xs[s] if pipe.is_first else None, ys[s] if pipe.is_last else None, loss_fn)
    return f"no error after {time.perf_counter() - started:.1f} s"


@pytest.mark.parametrize("nprocs", [2, 4])
def test_a_failure_on_one_rank_stops_both_replicas_with_its_traceback(ranks, nprocs):
    started = time.perf_counter()
    results = ranks("mpi", nprocs).run(gems_failing_step, 1, timeout=60, expect_errors=True)
    assert time.perf_counter() - started < 30  # never a hang: the error travels, no timeout is needed
    assert results[1].type_name == "ValueError" and "boom" in results[1].message, results[1]
    # named by replica and by the rank of the pipeline's communicator (replica B's stage s runs on rank p-1-s)
    failed = "stage 1 of replica A (rank 1) failed: ValueError: boom"
    for rank in set(range(nprocs)) - {1}:
        error = results[rank]
        assert error.type_name == "StageFailedError", (rank, error)
        assert failed in error.message and "Traceback" in error.message, (rank, error.message)


def gems_rank_skips_a_step(comm, skipping: int) -> tuple:
    from hpdl.errors import CommTimeoutError

    comm.timeout = 2.0
    pipe = Pipeline(make_model("mlp"), comm, chunks=4, schedule="gems")
    xs, ys = make_data("mlp")
    pipe.step(xs[0] if pipe.is_first else None, ys[0] if pipe.is_last else None, loss_fn)
    if comm.rank == skipping:
        return ("skipped",)
    started = time.perf_counter()
    try:
        pipe.step(xs[1] if pipe.is_first else None, ys[1] if pipe.is_last else None, loss_fn)
    except CommTimeoutError as error:
        return str(error), error.missing, time.perf_counter() - started
    return ("returned",)


def test_a_rank_that_skips_a_step_is_named_within_the_timeout(ranks):
    results = ranks("mpi", 2).run(gems_rank_skips_a_step, 1, timeout=60)
    assert results[1] == ("skipped",)
    message, missing, seconds = results[0]
    assert missing == (1,) and seconds < 10, results[0]
    assert "(rank 0) waited 2.0 s for" in message and "of replica" in message and "(rank 1)" in message, message
