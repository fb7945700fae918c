"""`hpdl plan validate` on 4 ranks: the plans of the CNN and the Inception block that once split the ranks.

`make plan-validate` died at 4 ranks (issue 55): in the CNN's dp2 x pp2
pipelines DataParallel re-broadcast batch norm's running statistics before
every micro-batch's forward, which failed the earlier micro-batches' backward
on the receiving ranks only; the Inception block's 4-stage pipelines leave a
stage without parameters, and only that rank failed to build its optimizer.
The other ranks then waited on those ranks in the plan's communicators until
the job died. Here the smallest of those plans (tiny models, one timed step)
run beside a spatial (sp4), a branch-parallel (tp4) and a ZeRO-3 x pipeline (dp2 x pp2) plan through the
harness's own loop (`validate.run_plans`), on one 4-rank pool: every plan runs
on every rank and every rank reports the same results.
"""

from __future__ import annotations

import math
import time

from hpdl.plan import validate

# (model, label, Plan fields) as the planner writes them for the quick models on 4 ranks (balance included)
PLANS = [
    ("cnn", "dp1 pp1 tp1 z0 sp4", {"dp": 1, "sp": 4}),
    ("cnn", "dp2 pp2 tp1 z0 m2 gpipe", {"dp": 2, "pp": 2, "micro_batches": 2, "schedule": "gpipe", "balance": [4, 11]}),
    ("inception", "dp1 pp1 tp4 z0", {"dp": 1, "tp": 4}),
    # 7 layers, 3 with parameters (stem, block, head): one of 4 stages has none
    ("inception", "dp1 pp4 tp1 z0 m4 1f1b", {"dp": 1, "pp": 4, "micro_batches": 4, "schedule": "1f1b",
                                             "balance": [1, 1, 1, 4]}),
    # ZeRO-3 inside a pipeline (issue 54): each stage's parameters sharded over its dp pair, gathered per micro-batch
    ("mlp", "dp2 pp2 tp1 z3 m2 1f1b", {"dp": 2, "pp": 2, "zero_stage": 3, "micro_batches": 2, "schedule": "1f1b",
                                       "reshard_after_forward": True, "balance": [2, 5]}),
]  # fmt: skip


def plans_body(comm, job):
    return validate.run_plans(comm, job)


def test_four_ranks_run_the_spatial_branch_and_pipeline_plans_together(ranks):
    job = {
        "plans": [{"id": i, "model": m, "plan": label, "fields": f} for i, (m, label, f) in enumerate(PLANS)],
        "models": {name: validate.model_spec(name, quick=True) for name in ("cnn", "inception", "mlp")},
        "steps": 1,
        "warmup": 0,
    }
    per_rank = ranks("mpi", 4).run(plans_body, job, timeout=90)
    assert all(mine == per_rank[0] for mine in per_rank)  # one agreement: the same rows on every rank
    assert [r["id"] for r in per_rank[0]] == list(range(len(PLANS)))
    failed = {PLANS[r["id"]][:2]: r["error"] for r in per_rank[0] if r["error"]}
    assert not failed, failed
    for r in per_rank[0]:
        assert r["measured_s"] > 0 and math.isfinite(r["measured_s"]) and len(r["steps_s"]) == 1


def one_rank_fails_body(comm, job):
    """Rank 1 alone is given a plan that `Plan` refuses: it fails before the mesh exists, while the others
    wait for it in that plan's communicator (its mesh's split)."""
    if comm.rank == 1:
        first = dict(job["plans"][0], fields=dict(job["plans"][0]["fields"], sp_typo=4))
        job = dict(job, plans=[first, *job["plans"][1:]])
    started = time.perf_counter()
    return validate.run_plans(comm, job), time.perf_counter() - started


def test_a_plan_that_fails_on_one_rank_is_a_failed_row_on_every_rank_and_the_next_plan_runs(ranks):
    job = {
        "plans": [{"id": 0, "model": "cnn", "plan": "dp1 pp1 tp1 z0 sp4", "fields": {"dp": 1, "sp": 4}},
                  {"id": 1, "model": "inception", "plan": "dp2 pp1 tp2 z0", "fields": {"dp": 2, "tp": 2}}],
        "models": {name: validate.model_spec(name, quick=True) for name in ("cnn", "inception")},
        "steps": 1,
        "warmup": 0,
    }  # fmt: skip
    per_rank = ranks("mpi", 4).run(one_rank_fails_body, job, timeout=90)
    rows = per_rank[0][0]
    assert all(mine == rows for mine, _ in per_rank)
    failed, next_plan = rows
    assert failed["measured_s"] is None and failed["failed_ranks"] == [0, 1, 2, 3], failed["rank_errors"]
    # the others' errors say that rank 1 left; the report names the one that started it
    assert failed["error"].startswith("rank 1: TypeError:") and "sp_typo" in failed["error"], failed["rank_errors"]
    assert next_plan["error"] == "" and next_plan["measured_s"] > 0
    # the others learnt of it from the communicators rank 1 abandoned, not by waiting out their timeout
    assert max(seconds for _, seconds in per_rank) < 30
