"""`hpdl bench dask --quick` end to end: every row and target line present, numbers in range, the same results.

One launch of 4 ranks at tiny sizes (timings under a loaded machine are not asserted against the targets: the
verdict of each target line must be the one its numbers earn, whichever it is). Three of the five workloads run
(a p2p shuffle and the scheduler-bound tasks beside x + x.T): the merge and K-Means cost 25 s more here in
imports and compiled kernels, and tests/test_dask_cluster.py runs both over each transport."""

from __future__ import annotations

import json

import pytest

from hpdl.bench.dask_transport import CLUSTERS, ONE, PROTOCOLS, TARGETS, _ceiling, launch
from targets import checked_targets

SIZES = (1, 1 << 20)
WORKLOADS = ("x+x.T", "groupby", "tasks")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], str]:
    out = tmp_path_factory.mktemp("dask_bench")
    argv = ["--quick", "--sizes", *map(str, SIZES), "--reps", "2", "--xxt-reps", "1", "--out", str(out)]
    argv += ["--rows", "8000", "--tasks", "50", "--workloads", ",".join(WORKLOADS)]
    assert launch(argv) == 0
    return json.loads((out / "dask.json").read_text()), (out / "dask.md").read_text()


def test_pingpong_rows_for_every_size_and_transport(quick: tuple[list[dict], str]) -> None:
    records, markdown = quick
    ping = {(r["transport"], r["bytes"]): r for r in records if r["measurement"] == "pingpong"}
    assert set(ping) == {(p, b) for p in PROTOCOLS for b in SIZES}
    for (_, nbytes), r in ping.items():
        assert 1 <= r["latency_us"]["median"] < 1e6, r  # a microsecond to a second per one-way message
        assert r["latency_us"]["min"] <= r["latency_us"]["median"] <= r["latency_us"]["max"]
        seconds = nbytes * r["window"] / (r["throughput_MBps"]["median"] * 1e6)
        assert 1e-6 < seconds < 60, r
    for nbytes in SIZES:
        mpi, tcp = ping[("mpi", nbytes)], ping[("tcp", nbytes)]
        ratio = mpi["throughput_MBps"]["median"] / tcp["throughput_MBps"]["median"]
        assert mpi["throughput_vs_tcp"] == pytest.approx(ratio)
        assert f"| {'1 B' if nbytes == 1 else '1 MiB'} " in markdown


def test_every_workload_on_both_transports_with_the_same_result(quick: tuple[list[dict], str]) -> None:
    records, markdown = quick
    work = {(r["measurement"], r["transport"]): r for r in records if r["measurement"] in WORKLOADS}
    assert set(work) == {(w, p) for w in WORKLOADS for p in CLUSTERS}
    for w in WORKLOADS:
        tcp, mpi, one = (work[(w, p)] for p in CLUSTERS)
        assert tcp["result"] == mpi["result"] == one["result"], w  # checked equal on every run by the benchmark
        assert (tcp["workers"], mpi["workers"], one["workers"]) == (2, 2, 1)
        for r in (tcp, mpi, one):
            assert 0 < r["seconds"]["median"] < 300, r
            # the job's processes worked during the run, and at most every core all the time (with slack for the
            # CPU read before and after it)
            assert 0 < r["cpu_seconds"]["median"] <= r["cores"] * r["seconds"]["max"] + 1.0, r
        assert mpi["speedup_vs_tcp"] == pytest.approx(tcp["seconds"]["median"] / mpi["seconds"]["median"])
        assert f"| {w} " in markdown and f"| {ONE} " in markdown
        assert mpi["ceiling_vs_tcp"] > 0
    assert work[("tasks", "mpi")]["result"] == {"tasks": 50, "sum": 49 * 50 // 2}
    groupby = work[("groupby", "mpi")]["result"]
    assert groupby["x_count"] == 8000 and 1 < groupby["groups"] <= 800  # every row in one of rows/10 keys
    assert work[("x+x.T", "mpi")]["result"] == pytest.approx(1000 * 1000, rel=0.01)  # uniform [0, 1): about n**2


def test_target_lines_name_their_values_and_earn_their_verdicts(quick: tuple[list[dict], str]) -> None:
    _, markdown = quick
    targets = checked_targets(markdown)  # each verdict the one its numbers earn
    subjects = [t.split(" ", 2)[1] for t in targets]
    assert subjects == ["latency,", "throughput,", "throughput,", *(f"{w}:" for w in WORKLOADS if w in TARGETS)]
    for line in targets[3:]:  # each workload's line says how far any transport could go here, and why
        assert "ceiling for any transport here" in line and ("CPU-s" in line or "half that" in line)


def test_the_ceiling_is_the_slower_of_perfect_scaling_and_the_cpu_the_work_needs() -> None:
    tcp = {"seconds": {"median": 3.0}}
    cpu_bound = {"seconds": {"median": 4.0}, "cpu_seconds": {"median": 5.0}, "cores": 2}
    assert _ceiling(tcp, cpu_bound)[0] == pytest.approx(3.0 / 2.5)  # 5 CPU-s on 2 cores: 2.5 s at best
    assert "5.00 CPU-s" in _ceiling(tcp, cpu_bound)[1]
    many_cores = {"seconds": {"median": 4.0}, "cpu_seconds": {"median": 5.0}, "cores": 16}
    assert _ceiling(tcp, many_cores)[0] == pytest.approx(3.0 / 2.0)  # half the single worker's 4 s
    assert "half that" in _ceiling(tcp, many_cores)[1]


def test_bad_arguments_return_an_exit_code() -> None:
    assert launch(["--reps", "0"]) == 2
    assert launch(["--sizes", "lots"]) == 2
    assert launch(["--workloads", "sort"]) == 2
    assert launch(["--link", "fast"]) == 2
