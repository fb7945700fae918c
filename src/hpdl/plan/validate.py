"""Prediction against measurement: run every plan that fits on 1, 2 and 4 ranks and compare step times.

For each world size and model (a small MLP, GPT, CNN and Inception block), the
planner searches the calibrated cluster of this machine; every candidate that
fits (within a bounded set of micro-batch counts) is then run for a few steps
with the real strategies (`hpdl.parallel.build`: DataParallel, ZeRO,
Pipeline, tensor, spatial and branch parallelism) in one MPI launch per world
size, each plan after the other on a communicator of its own, the ranks
agreeing after each on its times or its error (`run_plans`). The step time is
the median over the timed steps of the slowest rank. Reported: predicted and
measured side by side, the share of plans predicted within 25%, and whether
the plan predicted best runs within 10% of the best measured one.

Worker entry: `python -m hpdl.plan.validate --worker SPEC.json OUT.json`.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import hpdl.settings as settings

if TYPE_CHECKING:
    from hpdl.runtime.hosts import Hosts

__all__ = ["Options", "run", "run_plans", "summarize", "markdown", "plot", "MODELS", "main"]

MODELS = ("mlp", "gpt", "cnn", "inception")
TOLERANCE = 0.25
BEST_TOLERANCE = 0.10


@dataclass(frozen=True)
class Options:
    """One validation run; the lead runs the full size on a quiet machine."""

    ranks: tuple[int, ...] = (1, 2, 4)
    models: tuple[str, ...] = MODELS
    quick: bool = False
    steps: int = 5
    """Timed steps per plan (after `warmup`)."""
    warmup: int = 1
    max_micro_batches: int = 4
    recompute: tuple[str, ...] = ("never", "always")
    schedules: tuple[str, ...] = ("1f1b", "gpipe")
    cluster: Optional[str] = None
    """A cluster file (from `hpdl plan calibrate`); None: calibrate now."""
    out: str = "bench-results/plan"
    timeout: float = 1800.0
    hosts: Optional[Hosts] = None
    """Run the ranks on these hosts (`hpdl.runtime.hosts.parse_hosts("a:2,b:2")`), reached through `rsh`; None:
    this machine. Calibrating now then measures the links inside and between the hosts apart."""
    rsh: str = "ssh"
    plans: tuple[str, ...] = ()
    """Run only the plans whose label matches one of these shell patterns ('dp1 pp4 *', '*sp4*'); () all."""


def quick_options(**overrides: Any) -> Options:
    """A seconds-scale subset: 1 and 2 ranks, tiny models, 1F1B only, no recomputation, 2 timed steps."""
    values: dict[str, Any] = dict(
        ranks=(1, 2), quick=True, steps=2, warmup=1, max_micro_batches=2, recompute=("never",), schedules=("1f1b",)
    )
    values.update(overrides)
    return Options(**values)


# --------------------------------------------------------------------------- models (both sides use these)
def _inception(spec: dict[str, Any]) -> tuple[Any, Callable[[int, int], tuple[Any, Any]], Callable[..., Any]]:
    """A stem, one `Branches` block (1x1; 1x1 then 3x3; 1x1 then 5x5; pool then 1x1: concat) and a head: a plan
    with tp > 1 spreads the block's branches over the tp ranks (`BranchParallel`)."""
    import torch
    from torch import nn

    from hpdl.parallel.branch import Branches

    w, size, classes = spec["width"], spec["size"], spec["classes"]

    def conv(cin: int, cout: int, k: int) -> nn.Module:
        return nn.Conv2d(cin, cout, k, padding=k // 2)

    block = Branches(
        [
            conv(w, 2 * w, 1),
            nn.Sequential(conv(w, 2 * w, 1), nn.ReLU(), conv(2 * w, 4 * w, 3)),
            nn.Sequential(conv(w, w, 1), nn.ReLU(), conv(w, 2 * w, 5)),
            nn.Sequential(nn.MaxPool2d(3, 1, 1), conv(w, w, 1)),
        ],
        "concat",
    )
    model = nn.Sequential(conv(3, w, 3), nn.ReLU(), block, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(9 * w, classes))  # fmt: skip

    def images(seed: int, rows: int) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(rows, 3, size, size, generator=g), torch.randint(0, classes, (rows,), generator=g)

    return model, images, nn.functional.cross_entropy


def model_spec(name: str, quick: bool) -> dict[str, Any]:
    """Sizes of the validation models; the same dict travels to the worker."""
    if name == "mlp":
        return {"name": "mlp", "inputs": 64 if quick else 512, "width": 128 if quick else 1024,
                "pairs": 2 if quick else 3, "classes": 16, "batch": 32 if quick else 128}  # fmt: skip
    if name == "gpt":
        return {"name": "gpt", "vocab": 64, "block": 16 if quick else 64, "layers": 2 if quick else 4, "heads": 4,
                "embd": 32 if quick else 192, "batch": 8 if quick else 16}  # fmt: skip
    if name == "cnn":  # the spatial plans' model: convolutions, batch norm, a stride-2 layer, a replicated head
        return {"name": "cnn", "size": 32 if quick else 128, "width": 8 if quick else 16, "classes": 10,
                "batch": 4 if quick else 8}  # fmt: skip
    if name == "inception":  # the branch plans' model: one Inception block of 4 branches of different cost
        return {"name": "inception", "size": 16 if quick else 64, "width": 4 if quick else 16, "classes": 10,
                "batch": 4 if quick else 16}  # fmt: skip
    raise ValueError(f"unknown validation model {name!r}; use {', '.join(MODELS)}")


def build_model(spec: dict[str, Any]) -> tuple[Any, Callable[[int, int], tuple[Any, Any]], Callable[..., Any]]:
    """(model, batch(seed, rows) -> (x, y), loss_fn) for a model spec."""
    import torch
    from torch import nn

    if spec["name"] == "mlp":
        layers: list[nn.Module] = []
        width, inputs = spec["width"], spec["inputs"]
        for i in range(spec["pairs"]):
            # Megatron pairs: column (split outputs), ReLU, row (split inputs, outputs summed).
            out = spec["classes"] if i == spec["pairs"] - 1 else inputs
            layers += [nn.Linear(inputs, width), nn.ReLU(), nn.Linear(width, out)]
            if i < spec["pairs"] - 1:
                layers.append(nn.ReLU())
        model = nn.Sequential(*layers)
        plan = {}
        for idx, layer in enumerate(model):
            if isinstance(layer, nn.Linear):
                plan[str(idx)] = "column" if layer.in_features == inputs else "row"
        model.tp_plan = plan  # type: ignore[assignment]

        def batch(seed: int, rows: int) -> tuple[Any, Any]:
            g = torch.Generator().manual_seed(seed)
            return torch.randn(rows, inputs, generator=g), torch.randint(0, spec["classes"], (rows,), generator=g)

        return model, batch, nn.functional.cross_entropy
    if spec["name"] == "cnn":
        w, size, classes = spec["width"], spec["size"], spec["classes"]

        def block(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
            return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

        cnn = nn.Sequential(
            *block(3, w), *block(w, w), *block(w, 2 * w, stride=2), *block(2 * w, 2 * w),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * w, classes),
        )  # fmt: skip

        def images(seed: int, rows: int) -> tuple[Any, Any]:
            g = torch.Generator().manual_seed(seed)
            return torch.randn(rows, 3, size, size, generator=g), torch.randint(0, classes, (rows,), generator=g)

        return cnn, images, nn.functional.cross_entropy
    if spec["name"] == "inception":
        return _inception(spec)
    from hpdl.models.gpt import GPT, GPTConfig, lm_loss

    config = GPTConfig(vocab_size=spec["vocab"], block_size=spec["block"], n_layer=spec["layers"],
                       n_head=spec["heads"], n_embd=spec["embd"])  # fmt: skip
    gpt = GPT(config)

    def tokens(seed: int, rows: int) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, spec["vocab"], (rows, spec["block"] + 1), generator=g)
        return ids[:, :-1], ids[:, 1:]

    return gpt, tokens, lm_loss


# --------------------------------------------------------------------------- worker (every rank)
AGREEMENT_MARGIN_S = 30.0
"""Seconds the agreement after a plan waits beyond two of the plan's own waits: a rank that failed waits there
while the others notice (at once in a collective, where the failed rank's sub-communicators say it left; within
one bounded wait in a pipeline's point-to-point messages)."""
CONSEQUENCES = ("CollectiveMismatchError", "CommTimeoutError", "CommError", "StageFailedError")
"""Errors that report another rank's failure: the report names the first error that is none of these."""


def _run_plan(comm: Any, fields: dict[str, Any], spec: dict[str, Any], steps: int, warmup: int) -> list[float]:
    """Step times (seconds, this rank) of one plan on `comm`; on an error the mesh is left to the caller, who
    abandons `comm` and everything split from it (closing would wait on ranks that may never come)."""
    import torch

    from hpdl.parallel.mesh import Mesh, build
    from hpdl.parallel.mesh.plan_config import Plan

    torch.manual_seed(0)
    model, batch, loss_fn = build_model(spec)
    plan = Plan(**fields)
    mesh = Mesh.from_plan(comm, plan)
    wrapped, optimizer = build(model, mesh, plan, optimizer=torch.optim.Adam, lr=1e-3)
    coords = mesh.coordinates()
    rows = spec["batch"] // plan.dp
    if plan.tp > 1 and spec["name"] == "gpt":
        from hpdl.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy

        tp_comm = mesh.tp

        def loss(out: Any, y: Any) -> Any:
            return vocab_parallel_cross_entropy(out, y, tp_comm)
    else:
        loss = loss_fn
    times = []
    for i in range(warmup + steps):
        x, y = batch(1000 * i + coords["dp"], rows)
        if plan.sp > 1:
            x = wrapped.shard(x)  # this rank's slab of each image
        comm.barrier()
        start = time.perf_counter()
        if plan.pp > 1:
            wrapped.step(x, y, loss)
        else:
            loss(wrapped(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    if hasattr(wrapped, "close"):
        wrapped.close()
    mesh.close()
    return times


def _abandon(comm: Any) -> None:
    """Close `comm` and every communicator split from it without meeting the other ranks: each posts that this
    rank left (a peer waiting in one of their collectives raises at once) and keeps its engine resources."""
    pending = [comm]
    while pending:
        sub = pending.pop()
        sub._broken = True  # as hpdl.runtime.world.abandon marks a failing rank's worlds
        pending.extend(sub._children)
    comm.close()


def _attempt(scope: Any, item: dict[str, Any], job: dict[str, Any]) -> tuple[list[float], str]:
    """One plan on `scope`: its times, or no times and this rank's error (`scope` is then abandoned)."""
    try:
        return _run_plan(scope, item["fields"], job["models"][item["model"]], job["steps"], job["warmup"]), ""
    except Exception as exc:  # one plan's failure is a row of the report, not the end of the run
        _abandon(scope)
        error = f"rank {scope.rank}: {type(exc).__name__}: {exc}"
        if settings.flag("HPDL_PLAN_DEBUG"):
            error += "\n" + traceback.format_exc()
            print(f"hpdl plan validate: plan {item['plan']}: {error}", file=sys.stderr, flush=True)
        return [], error


def first_error(errors: Sequence[str]) -> str:
    """The error that started a plan's failure: the first one that does not report another rank's."""
    for error in errors:
        kind = error.split(": ", 2)[1] if error.count(": ") >= 2 else ""
        if kind not in CONSEQUENCES:
            return error
    return errors[0] if errors else ""


def run_plans(comm: Any, job: dict[str, Any], out_path: Optional[str] = None) -> list[dict[str, Any]]:
    """Run `job`'s plans one after the other on every rank of `comm`; the same results on every rank.

    The plans run on a communicator split from `comm` (a new one after a plan that failed). After each plan
    every rank meets in one agreement on `comm` (an allgather of its times or its error, bounded by
    `AGREEMENT_MARGIN_S` beyond two of the plan's waits), so that a plan that failed on any rank is a failed
    row on all of them and they go on to the next plan together; a rank whose plan failed abandons the plan's
    communicator and all split from it first, and the others abandon theirs after the agreement. Rank 0 rewrites
    `out_path` after each plan, so that a job that ends early still reports what it measured.
    """
    import torch

    plan_limit = comm.timeout
    results = []
    scope = None
    try:
        for item in job["plans"]:
            comm.timeout = plan_limit  # the plan's communicators inherit it
            if scope is None:
                scope = comm.split(0, comm.rank)
            times, error = _attempt(scope, item, job)
            mine = statistics.median(times) if times else float("nan")
            comm.timeout = 2 * plan_limit + AGREEMENT_MARGIN_S
            gathered = comm.allgather_object((mine, error, [float(t) for t in times]))
            errors = [e for _, e, _ in gathered if e]
            if errors:  # its communicators may hold calls that will never complete: a new one for the next plan
                _abandon(scope)
                scope = None
            medians = [m for m, _, _ in gathered]
            per_step = [max(ts) for ts in zip(*[t for _, _, t in gathered])] if not errors else []
            results.append(
                {
                    "id": item["id"],
                    "measured_s": max(medians) if not errors else None,
                    "steps_s": per_step,
                    "error": first_error(errors),
                    "failed_ranks": [r for r, (_, e, _) in enumerate(gathered) if e],
                    "rank_errors": [e.splitlines()[0] if e else "" for _, e, _ in gathered],
                }
            )
            torch.manual_seed(0)
            if out_path and comm.rank == 0:
                with open(out_path + ".part", "w") as fh:
                    json.dump(results, fh)
                os.replace(out_path + ".part", out_path)
    finally:
        comm.timeout = plan_limit
    if scope is not None:
        scope.close()
    return results


def _worker(spec_path: str, out_path: str) -> None:
    import hpdl
    from hpdl.runtime.memory import keep_freed_memory

    keep_freed_memory()  # measured steps under the allocator the profile was timed under (hpdl.runtime.memory)
    with open(spec_path) as fh:
        job = json.load(fh)
    comm = hpdl.init("mpi")
    try:
        run_plans(comm, job, out_path)
    finally:
        hpdl.finalize()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpdl.plan.validate")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), required=True)
    ns = parser.parse_args(argv)
    _worker(*ns.worker)
    return 0


# --------------------------------------------------------------------------- parent
@dataclass
class Outcome:
    """Every record, the per-(model, ranks) summaries and where the files went."""

    records: list[dict[str, Any]]
    groups: list[dict[str, Any]]
    cluster: Any
    files: list[str] = field(default_factory=list)
    load: tuple[float, float] = (0.0, 0.0)
    """The share of the cores that other processes used just before and just after the runs (`_load`): timings
    from a busy machine are noise."""

    @property
    def within_share(self) -> float:
        measured = [r for r in self.records if r["measured_s"]]
        return sum(r["within_25"] for r in measured) / len(measured) if measured else float("nan")

    @property
    def best_ok(self) -> bool:
        return all(g["best_within_10"] for g in self.groups if g["best_within_10"] is not None)


def predictions(options: Options, cluster: Any) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Every (model, ranks, plan) the planner finds feasible, with its predicted step time."""
    import torch

    from hpdl.plan.cost import Workload
    from hpdl.plan.profile import measure
    from hpdl.plan.ranking import plan_fields, search

    rows: list[dict[str, Any]] = []
    specs = {}
    for name in options.models:
        spec = model_spec(name, options.quick)
        specs[name] = spec
        model, batch, _ = build_model(spec)

        def example(rows: int, make: Callable[[int, int], tuple[Any, Any]] = batch) -> Any:
            return make(0, rows)[0]

        reps = 2 if options.quick else 5
        profile = measure(model, example, name=name, batch=2, time_batches=(2, spec["batch"]), reps=reps)
        workload = Workload(batch=spec["batch"], precision="fp32", optimizer="adam")
        for n in options.ranks:
            sized = cluster if cluster.devices >= n else cluster.with_devices(1, n)
            result = search(
                profile,
                sized,
                workload,
                devices=n,
                max_micro_batches=options.max_micro_batches,
                schedules=options.schedules,
                recompute=options.recompute,
                measured=True,
                spatial=name == "cnn",  # dp x sp plans for the model whose layers run on slabs
            )
            for e in result.feasible:
                if options.plans and not any(fnmatch.fnmatchcase(e.candidate.label(), p) for p in options.plans):
                    continue
                rows.append(
                    {
                        "id": len(rows),
                        "model": name,
                        "ranks": n,
                        "plan": e.candidate.label(),
                        "fields": plan_fields(e.candidate, workload, e.stage_layers),
                        "predicted_s": e.step_s,
                        "breakdown": {k: v for k, v in e.to_dict().items() if k.endswith("_s")},
                    }
                )
        del model
    torch.manual_seed(0)
    return rows, specs


def measure_plans(
    rows: list[dict[str, Any]], specs: dict[str, Any], options: Options, ranks: int
) -> dict[int, dict[str, Any]]:
    """Run every plan of `rows` for `ranks` ranks in one MPI launch; results by row id."""
    from hpdl.runtime import spawn

    chosen = [r for r in rows if r["ranks"] == ranks]
    if not chosen:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as fh:
            json.dump({"plans": chosen, "models": specs, "steps": options.steps, "warmup": options.warmup}, fh)
        env = spawn.job_environment("mpi", ranks, hosts=options.hosts)
        env["OMP_NUM_THREADS"] = "1"
        env.setdefault("HPDL_TIMEOUT", "120")  # a plan that fails on one rank must not hold the others for long
        code = spawn.run(ranks, ["-m", "hpdl.plan.validate", "--worker", spec_path, out_path], env=env,
                         timeout=options.timeout, name="hpdl plan validate", hosts=options.hosts,
                         rsh=options.rsh)  # fmt: skip
        done: dict[int, dict[str, Any]] = {}
        if os.path.exists(out_path):  # rank 0 rewrites it after every plan
            with open(out_path) as fh:
                done = {r["id"]: r for r in json.load(fh)}
    if code != 0:
        lost = f"not run: the {ranks}-rank job ended early (exit code {code}; its output above says why)"
        print(f"hpdl plan validate: {lost}; {len(chosen) - len(done)} of its {len(chosen)} plans are reported as "
              "failed", file=sys.stderr)  # fmt: skip
        for r in chosen:
            done.setdefault(r["id"], {"id": r["id"], "measured_s": None, "steps_s": [], "error": lost})
    return done


def run(options: Options) -> Outcome:
    """Calibrate (or load the cluster), predict, measure, compare, and write JSON, Markdown and PNG."""
    from hpdl.plan.calibrate import calibrate
    from hpdl.plan.cluster import load_cluster_file

    top = max(options.ranks)
    load_before = _load()
    if options.cluster:
        cluster = load_cluster_file(options.cluster)
    else:
        cluster = calibrate(devices=top, quick=options.quick, hosts=options.hosts, rsh=options.rsh)
    rows, specs = predictions(options, cluster)
    for n in options.ranks:
        measured = measure_plans(rows, specs, options, n)
        for r in rows:
            if r["ranks"] == n:
                got = measured.get(r["id"], {})
                r["measured_s"] = got.get("measured_s")
                r["steps_s"] = got.get("steps_s", [])
                r["error"] = got.get("error", "not run")
    records, groups = summarize(rows)
    outcome = Outcome(records, groups, cluster, load=(load_before, _load()))
    outcome.files = write(outcome, options)
    return outcome


def summarize(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Add ratio and within-25% to each record; per (model, ranks): predicted best vs measured best."""
    for r in rows:
        m = r.get("measured_s")
        r["ratio"] = r["predicted_s"] / m if m else None
        r["within_25"] = bool(m and abs(r["predicted_s"] - m) <= TOLERANCE * m)
    groups = []
    keys = sorted({(r["model"], r["ranks"]) for r in rows})
    for model, n in keys:
        group = [r for r in rows if r["model"] == model and r["ranks"] == n and r.get("measured_s")]
        if not group:
            groups.append({"model": model, "ranks": n, "plans": 0, "best_within_10": None})
            continue
        predicted = min(group, key=lambda r: r["predicted_s"])
        measured = min(group, key=lambda r: r["measured_s"])
        slowdown = predicted["measured_s"] / measured["measured_s"]
        groups.append(
            {
                "model": model,
                "ranks": n,
                "plans": len(group),
                "predicted_best": predicted["plan"],
                "measured_best": measured["plan"],
                "predicted_best_measured_s": predicted["measured_s"],
                "measured_best_s": measured["measured_s"],
                "slowdown": slowdown,
                "best_within_10": slowdown <= 1 + BEST_TOLERANCE,
                "within_25_share": sum(r["within_25"] for r in group) / len(group),
            }
        )
    return rows, groups


def markdown(outcome: Outcome) -> str:
    from hpdl.plan.report import markdown_table

    rows = [
        [r["model"], r["ranks"], r["plan"], f"{r['predicted_s'] * 1e3:.2f}",
         f"{r['measured_s'] * 1e3:.2f}" if r.get("measured_s") else "-",
         f"{r['ratio']:.2f}" if r.get("ratio") else "-", "yes" if r["within_25"] else "no",
         (r.get("error") or "")[:60]]
        for r in outcome.records
    ]  # fmt: skip
    table = markdown_table(["model", "ranks", "plan", "predicted ms", "measured ms", "pred/meas", "within 25%",
                            "error"], rows)  # fmt: skip
    best_rows = [
        [g["model"], g["ranks"], g["plans"], g.get("predicted_best", "-"), g.get("measured_best", "-"),
         f"{g['slowdown']:.2f}" if g.get("slowdown") else "-",
         {True: "yes", False: "no", None: "-"}[g["best_within_10"]]]
        for g in outcome.groups
    ]  # fmt: skip
    best = markdown_table(["model", "ranks", "plans run", "predicted best", "measured best",
                           "its time / best", "within 10%"], best_rows)  # fmt: skip
    share = outcome.within_share
    failed = [r for r in outcome.records if r.get("error")]
    failures = [f"- {r['model']}, {r['ranks']} ranks, {r['plan']}: {r['error'].splitlines()[0]}" for r in failed]
    lines = [
        f"cluster: {outcome.cluster.name} ({outcome.cluster.source})",
        f"cores busy with other work: {outcome.load[0]:.0%} before the runs, {outcome.load[1]:.0%} after"
        + (" (busy: the measured times are not trustworthy)" if max(outcome.load) > 0.25 else ""),
        "",
        table,
        "",
        best,
        "",
        f"predicted within 25% of measured: {share:.0%} of plans (target >= 80%); predicted best within 10% of "
        f"the measured best in {sum(g['best_within_10'] is True for g in outcome.groups)} of "
        f"{sum(g['best_within_10'] is not None for g in outcome.groups)} groups (target >= 75%)"
        if share == share
        else "no plan was measured",
    ]
    if failures:
        lines += ["", f"{len(failed)} plan(s) failed (every rank went on to the next plan):", *failures]
    return "\n".join(lines)


def plot(path: str, outcome: Outcome) -> bool:
    """Predicted vs measured step time, log-log, with y = x and the 25% band."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    measured = [r for r in outcome.records if r.get("measured_s")]
    if not measured:
        return False
    fig, ax = plt.subplots(figsize=(5.5, 5))
    markers = {1: "o", 2: "s", 4: "^"}
    for model in sorted({r["model"] for r in measured}):
        for n in sorted({r["ranks"] for r in measured}):
            pts = [r for r in measured if r["model"] == model and r["ranks"] == n]
            if pts:
                ax.scatter([r["measured_s"] * 1e3 for r in pts], [r["predicted_s"] * 1e3 for r in pts],
                           marker=markers.get(n, "x"), label=f"{model}, {n} ranks", alpha=0.8)  # fmt: skip
    values = [r["measured_s"] * 1e3 for r in measured] + [r["predicted_s"] * 1e3 for r in measured]
    lo, hi = min(values) / 1.5, max(values) * 1.5
    ax.plot([lo, hi], [lo, hi], "k-", linewidth=1, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.75, hi * 0.75], [lo * 1.25, hi * 1.25], color="grey", alpha=0.2,
                    label="within 25%")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(f"hpdl plan validate: {outcome.within_share:.0%} within 25%", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write(outcome: Outcome, options: Options) -> list[str]:
    os.makedirs(options.out, exist_ok=True)
    config = {"options": options.__dict__, "cluster": outcome.cluster.to_dict(), "cores_busy_other": outcome.load}
    paths = []
    json_path = os.path.join(options.out, "validate.json")
    with open(json_path, "w") as fh:
        json.dump({"config": config, "records": outcome.records, "groups": outcome.groups,
                   "within_25_share": outcome.within_share, "best_within_10": outcome.best_ok}, fh, indent=1,
                  default=str)  # fmt: skip
    paths.append(json_path)
    md_path = os.path.join(options.out, "validate.md")
    with open(md_path, "w") as fh:
        fh.write("# hpdl plan validate\n\n" + markdown(outcome) + "\n")
    paths.append(md_path)
    png = os.path.join(options.out, "validate.png")
    if plot(png, outcome):
        paths.append(png)
    return paths


def _load(seconds: float = 0.25) -> float:
    """The share of the machine's cores that other processes keep busy, sampled over `seconds` while this one
    sleeps (the one-minute load average counted the calibration that `make plan-validate` had just run, and read
    "busy" before every run); the load average per core where /proc/stat is missing."""

    def busy_and_total() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            ticks = [int(v) for v in stat.readline().split()[1:]]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
        return sum(ticks) - idle, sum(ticks)

    try:
        busy0, total0 = busy_and_total()
        time.sleep(seconds)
        busy1, total1 = busy_and_total()
        return (busy1 - busy0) / max(1, total1 - total0)
    except (OSError, ValueError, IndexError):
        try:
            return os.getloadavg()[0] / (os.cpu_count() or 1)
        except OSError:
            return float("nan")


def parse_ranks(values: Sequence[str]) -> tuple[int, ...]:
    ranks = tuple(sorted({int(v) for v in values}))
    if not ranks or min(ranks) < 1 or max(ranks) > 4:
        raise ValueError(f"--ranks {list(values)}: use 1 to 4 ranks (the machine has few cores)")
    return ranks


if __name__ == "__main__":
    raise SystemExit(main())
