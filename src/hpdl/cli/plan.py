"""`hpdl plan`: predict step time and memory of every parallel plan, pick the best, simulate other clusters.

hpdl plan --model gpt2-xl --batch 1024 --cluster 'nodes=128,gpus_per_node=8,gpu=h100,intra=nvlink,inter=ib-200'
hpdl plan --model my_model.py:make_model --batch 512 --cluster cluster.toml --out plan.toml
    (your file, defining make_model() and example_input(batch); docs/plan.md shows one)
hpdl plan memory --params 7.5e9 --dp 64 --optimizer adam --precision mixed
hpdl plan calibrate --out cluster.toml
hpdl plan validate [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

from hpdl.runtime.memory import keep_freed_memory

__all__ = ["run_argv"]

SUBCOMMANDS = ("memory", "calibrate", "validate")


def run_argv(argv: list[str]) -> int:
    """Entry from `hpdl plan ...`: a subcommand, or the search."""
    # Profiles and calibration time tensors in this process: under the allocator the ranks use
    # (spawn.job_environment puts tensors of 2 MB and more on huge pages; torch reads the variable at its
    # first large allocation, which has not happened yet).
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    keep_freed_memory()  # profiles timed on fresh pages alternated between 24 and 39 ms (hpdl.runtime.memory)
    try:
        if argv[:1] == ["memory"]:
            return _memory(argv[1:])
        if argv[:1] == ["calibrate"]:
            return _calibrate(argv[1:])
        if argv[:1] == ["validate"]:
            return _validate(argv[1:])
        return _search(argv)
    except SystemExit as stop:  # argparse: --help (0) and usage errors (2)
        return stop.code if isinstance(stop.code, int) else 0
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"hpdl plan: {exc}", file=sys.stderr)
        return 2


# --------------------------------------------------------------------------- search
def _search_parser() -> argparse.ArgumentParser:
    from hpdl.plan.models import NAMES

    parser = argparse.ArgumentParser(
        prog="hpdl plan",
        description="Predict step time and memory for every (dp, pp, tp, ZeRO stage, micro-batches, schedule, "
        "recomputation) that fits, rank them, and write the best as a plan file. Subcommands: "
        "memory (ZeRO model-state formulas), calibrate (measure this machine), validate (predicted vs measured).",
        epilog="Presets (datasheet figures): gpu=" + ", ".join(_preset_names()) + "; "
        "links: nvlink, pcie4, pcie5, ib-100, ib-200, ib-400, eth-25, eth-100. See docs/plan.md.",
    )
    parser.add_argument("--model", required=True, help=f"{', '.join(NAMES)}, or path/to/model.py:factory")
    parser.add_argument("--batch", type=int, required=True, help="global batch (samples per optimizer step)")
    parser.add_argument(
        "--cluster",
        required=True,
        help="cluster TOML file, a device preset (h100), or inline: "
        "'nodes=128,gpus_per_node=8,gpu=h100,intra=nvlink,inter=ib-200'",
    )
    parser.add_argument("--devices", type=int, help="plan for this many devices (default: the whole cluster)")
    parser.add_argument("--precision", choices=["mixed", "fp32", "bf16"], default="mixed")
    parser.add_argument("--optimizer", choices=["adam", "adamw", "sgd", "sgd-momentum"], default="adam")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size (default 25)")
    parser.add_argument("--seq", type=int, help="sequence length of a reference transformer (default: published)")
    parser.add_argument("--max-micro-batches", type=int, default=256)
    parser.add_argument(
        "--schedules",
        nargs="+",
        choices=["1f1b", "gpipe", "gems"],
        default=["1f1b", "gpipe"],
        help="pipeline schedules to search (default 1f1b gpipe; gems: two mirrored replicas)",
    )
    parser.add_argument("--top", type=int, default=10, help="rows of the ranking table (default 10)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")
    parser.add_argument("--out", help="write the best plan as a plan file (.toml or .json) for hpdl.parallel.build")
    return parser


def _preset_names() -> list[str]:
    from hpdl.plan.presets import DEVICES

    return sorted(DEVICES)


def load_profile(model: str, precision: str, seq: Optional[int] = None) -> Any:
    """A reference model by name, or a user model `path.py:factory` measured once."""
    from hpdl.plan.models import NAMES, reference_profile
    from hpdl.plan.profile import measure_factory

    act_bytes = 4 if precision == "fp32" else 2
    if model.lower() in NAMES:
        return reference_profile(model, seq=seq, act_bytes=act_bytes)
    if ":" not in model:
        raise ValueError(f"--model {model!r}: not a reference model ({', '.join(NAMES)}) nor path/to/model.py:factory")
    return measure_factory(model).at_dtype(act_bytes)


def _search(argv: list[str]) -> int:
    from hpdl.plan.cost import Workload
    from hpdl.plan.presets import parse_cluster
    from hpdl.plan.ranking import search
    from hpdl.plan.report import header, ranking_table, why

    ns = _search_parser().parse_args(argv)
    cluster = parse_cluster(ns.cluster)
    workload = Workload(batch=ns.batch, precision=ns.precision, optimizer=ns.optimizer, bucket_mb=ns.bucket_mb)
    profile = load_profile(ns.model, ns.precision, ns.seq)
    result = search(profile, cluster, workload, devices=ns.devices, max_micro_batches=ns.max_micro_batches,
                    schedules=tuple(ns.schedules))  # fmt: skip
    written = None
    if ns.out and result.best is not None:
        written = write_plan(result, ns.out)
    if ns.json:
        data = result.to_dict(top=ns.top)
        data["plan_file"] = written
        print(json.dumps(data, indent=2, default=str))
    else:
        print(header(result))
        print()
        if result.feasible:
            print(ranking_table(result, ns.top))
            print()
        print(why(result))
        if written:
            print(f"\nbest plan written to {written} (hpdl.parallel.Plan.from_file reads it)")
    if ns.out and result.best is None:
        print(f"hpdl plan: nothing fits, so {ns.out} was not written", file=sys.stderr)
        return 1
    return 0 if result.best is not None else 1


def write_plan(result: Any, path: str) -> str:
    """Write the best plan with `hpdl.parallel.Plan.to_file` (the mesh's own writer, so build() reads it)."""
    if not path.endswith((".toml", ".json")):
        raise ValueError(f"--out {path!r}: a plan file ends in .toml or .json")
    if result.best.candidate.schedule == "gems" and result.best.candidate.pp > 1:
        raise ValueError(
            "--out: the best plan runs schedule='gems', which plan files and build() do not take; build it with "
            "Pipeline(model, pp, schedule='gems', data_parallel=dp), or search without gems"
        )
    return str(result.best_plan().to_file(path))


# --------------------------------------------------------------------------- memory
def _memory(argv: list[str]) -> int:
    from hpdl.plan.memory import bubble_fraction
    from hpdl.plan.report import memory_rows, memory_table

    parser = argparse.ArgumentParser(
        prog="hpdl plan memory",
        description="Model-state memory per device for plain data parallelism and ZeRO stages 1, 2, 3 "
        "(Rajbhandari et al. 2020): with mixed-precision Adam 16 bytes per parameter, split as the stages say.",
    )
    parser.add_argument("--params", type=float, required=True, help="parameters, e.g. 7.5e9")
    parser.add_argument("--dp", type=int, required=True, help="data-parallel ranks")
    parser.add_argument("--optimizer", choices=["adam", "adamw", "sgd", "sgd-momentum"], default="adam")
    parser.add_argument("--precision", choices=["mixed", "fp32", "bf16"], default="mixed")
    parser.add_argument("--pp", type=int, help="also print the pipeline bubble for this many stages")
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches for the bubble (default 1)")
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args(argv)
    if ns.params <= 0 or ns.dp < 1:
        parser.error("--params must be > 0 and --dp >= 1")
    if ns.json:
        data: dict[str, Any] = {
            "params": ns.params,
            "dp": ns.dp,
            "optimizer": ns.optimizer,
            "precision": ns.precision,
            "rows": memory_rows(ns.params, ns.dp, ns.optimizer, ns.precision),
        }
        if ns.pp:
            frac = bubble_fraction(ns.pp, ns.micro_batches)
            data["bubble"] = {"pp": ns.pp, "micro_batches": ns.micro_batches, "fraction": float(frac),
                              "exact": f"{frac.numerator}/{frac.denominator}"}  # fmt: skip
        print(json.dumps(data, indent=2))
    else:
        print(memory_table(ns.params, ns.dp, ns.optimizer, ns.precision, ns.pp, ns.micro_batches))
    return 0


# --------------------------------------------------------------------------- calibrate
def _calibrate(argv: list[str]) -> int:
    from hpdl.plan.calibrate import calibrate

    parser = argparse.ArgumentParser(
        prog="hpdl plan calibrate",
        description="Measure this machine (matmul FLOP/s per dtype on one thread and all cores, and per rank "
        "with every rank of a --devices job busy at once when they outnumber the cores; per-layer overhead, memory "
        "bandwidth, allreduce and send/recv latency and bandwidth on 2 MPI ranks) and write a cluster file for "
        "`hpdl plan --cluster` (with the cores per device).",
    )
    parser.add_argument("--out", default="cluster.toml", help="cluster file to write (default cluster.toml)")
    parser.add_argument("--devices", type=int, help="ranks the node runs (one thread each; default 4; with -H: "
                        "every slot of the hosts)")  # fmt: skip
    parser.add_argument("--ranks", type=int, default=2, help="MPI ranks of the collective probe (default 2)")
    parser.add_argument("--bench-json", help="fit the links from an `hpdl bench comm` run (its comm.json)")
    parser.add_argument("--no-comm", action="store_true", help="skip the MPI probes (links assumed; no busy probe)")
    parser.add_argument("--overlap", type=float, default=0.0, help="share of backward that hides gradient "
                        "communication (not measured; default 0 on CPU)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (seconds)")
    _hosts_arguments(parser, "the cluster is these hosts: the links inside and between them measured apart")
    ns = parser.parse_args(argv)
    hosts = _hosts(ns)
    devices = ns.devices or (hosts.total if hosts is not None else 4)
    if devices < 1 or ns.ranks < 2:
        parser.error("--devices must be >= 1 and --ranks >= 2")
    cluster = calibrate(
        devices=devices,
        ranks=ns.ranks,
        quick=ns.quick,
        bench_json=ns.bench_json,
        overlap=ns.overlap,
        measure_comm=not ns.no_comm,
        hosts=hosts,
        rsh=ns.launcher_exec,
    )
    cluster.write(ns.out)
    print(cluster.to_toml().rstrip())
    print(f"\ncluster written to {ns.out}")
    return 0


def _hosts_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("-H", "--hosts", help=f"hosts and slots, e.g. a:2,b:2 ({what})")
    parser.add_argument("--hostfile", help="an mpirun-style hostfile instead of -H")
    parser.add_argument("--launcher-exec", default="ssh", help="remote shell that reaches the hosts (default ssh)")


def _hosts(ns: argparse.Namespace) -> Any:
    from hpdl.runtime.hosts import parse_hostfile, parse_hosts

    if ns.hosts and ns.hostfile:
        raise ValueError("give -H or --hostfile, not both")
    if ns.hosts:
        return parse_hosts(ns.hosts)
    return parse_hostfile(ns.hostfile) if ns.hostfile else None


# --------------------------------------------------------------------------- validate
def _validate(argv: list[str]) -> int:
    from hpdl.plan import validate

    parser = argparse.ArgumentParser(
        prog="hpdl plan validate",
        description="Run every plan the planner finds feasible for a small MLP, GPT, CNN and Inception block on "
        "1, 2 and 4 ranks with the real strategies (a plan that fails on any rank is a failed row; the run goes "
        "on), and print predicted next to measured step time (plus JSON, Markdown "
        "and a PNG scatter plot). Targets: >= 80%% of plans within 25%%; the predicted best within 10%% of the "
        "measured best. Run it on a quiet machine: timings on a shared one are noise.",
    )
    parser.add_argument("--quick", action="store_true", help="1 and 2 ranks, tiny models, few steps (a smoke test)")
    parser.add_argument("--ranks", nargs="+", help="world sizes (default 1 2 4; --quick: 1 2)")
    parser.add_argument("--models", nargs="+", choices=list(validate.MODELS), help="models (default: all)")
    parser.add_argument("--cluster", help="cluster file from `hpdl plan calibrate` (default: calibrate now)")
    parser.add_argument("--steps", type=int, help="timed steps per plan (default 5; --quick 2)")
    parser.add_argument("--out", default="bench-results/plan", help="output folder (default bench-results/plan)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per world size before stopping")
    parser.add_argument("--plans", nargs="+", metavar="PATTERN", help="only the plans whose label matches one of "
                        "these shell patterns, e.g. 'dp1 pp4 *' '*sp4' (labels as the report prints them)")  # fmt: skip
    _hosts_arguments(parser, "run the plans across them; default world size: every slot")
    ns = parser.parse_args(argv)
    hosts = _hosts(ns)
    overrides: dict[str, Any] = {"out": ns.out, "cluster": ns.cluster, "timeout": ns.timeout}
    if hosts is not None:
        overrides.update(hosts=hosts, rsh=ns.launcher_exec, ranks=(hosts.total,))
    if ns.ranks:
        overrides["ranks"] = validate.parse_ranks(ns.ranks)
    if ns.models:
        overrides["models"] = tuple(ns.models)
    if ns.steps:
        overrides["steps"] = ns.steps
    if ns.plans:
        overrides["plans"] = tuple(ns.plans)
    options = validate.quick_options(**overrides) if ns.quick else validate.Options(**overrides)
    outcome = validate.run(options)
    print(validate.markdown(outcome))
    print("\nwritten: " + ", ".join(outcome.files))
    return 0
