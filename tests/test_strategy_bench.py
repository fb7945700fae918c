"""Smoke tests of `hpdl bench train --strategy spatial|gems|branch --quick`: each runs end to end on 2 ranks.

They check the records' shape and the claims that do not depend on timing (memory per rank, the schedule's
counted bubble, the branch placement), never the speeds (benchmarks are not tests).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpdl.bench import train_branch, train_gems, train_spatial
from hpdl.bench.train import launch


def run(strategy: str, out: Path) -> tuple[list[dict[str, Any]], str]:
    assert launch(["--strategy", strategy, "--quick", "--out", str(out)]) == 0
    return json.loads((out / f"{strategy}.json").read_text()), (out / f"{strategy}.md").read_text()


def target_lines(markdown: str) -> list[str]:
    assert "## Targets" in markdown, markdown
    return [line[2:] for line in markdown.split("## Targets", 1)[1].splitlines() if line.startswith("- ")]


def earned(met: bool, value: float, target: float) -> set[str]:
    """The verdict a value earns against its target; either one within the printed rounding of it."""
    return {"PASS", "MISS"} if abs(value - target) < 0.006 else {"PASS" if met else "MISS"}


def timed(records: list[dict[str, Any]], contenders: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    by = {r["contender"]: r for r in records if r["contender"] in contenders}
    assert set(by) == set(contenders)
    for r in by.values():
        assert r["samples_per_s"]["median"] > 0 and r["world_ranks"] == 2 and r["torch_version"]
    return by


def test_spatial_quick_bench_splits_the_activations_and_reports_the_halo(tmp_path: Path) -> None:
    records, markdown = run("spatial", tmp_path)
    by = timed(records, train_spatial.CONTENDERS)
    assert by["single"]["peak_ratio"] == 1.0
    assert by["spatial"]["peak_ratio"] <= 0.6  # half the image per rank, plus halos
    assert by["pipeline"]["peak_ratio"] < 1.0
    halo = next(r for r in records if r["contender"] == "halo")
    assert halo["halo_bytes_per_step"] > 0 and 0.0 <= halo["hidden_fraction"] <= 1.0
    peer = next(r for r in records if r["contender"] == "torch-tp-conv")  # PyTorch's own: its result, or why not
    assert "output_error" in peer and "torch _tp_conv" in markdown
    speed = by["spatial"]["samples_per_s"]["median"] / by["pipeline"]["samples_per_s"]["median"]
    memory, hidden = by["spatial"]["peak_ratio"], halo["hidden_fraction"]
    want = [
        (earned(speed >= train_spatial.TARGET_VS_PIPELINE, speed, train_spatial.TARGET_VS_PIPELINE), f"{speed:.2f}x"),
        (earned(memory <= train_spatial.TARGET_MEMORY, memory, train_spatial.TARGET_MEMORY), f"{memory:.2f}x"),
        (earned(hidden >= train_spatial.TARGET_HIDDEN, hidden, train_spatial.TARGET_HIDDEN), f"{hidden:.0%}"),
    ]
    lines = target_lines(markdown)  # speed vs the pipeline, memory vs one process, the hidden share of halos
    assert len(lines) == len(want), lines
    for line, (verdicts, value) in zip(lines, want):
        assert line.split(" ", 1)[0] in verdicts and line.endswith(f": {value}"), (line, verdicts, value)


def test_gems_quick_bench_runs_every_schedule_with_gems_grid_free_of_bubbles(tmp_path: Path) -> None:
    records, markdown = run("gems", tmp_path)
    lines = target_lines(markdown)
    assert len(lines) == 4, lines  # per model: the speed against 1F1B, the measured bubble against 1F1B's
    for model in ("act", "mlp"):
        by = timed([r for r in records if r["model"] == model], train_gems.CONTENDERS)
        assert by["gems"]["bubble_grid"] == 0.0  # on 2 ranks the two mirrored replicas fill each other's bubble
        assert by["1f1b"]["bubble_grid"] == by["gpipe"]["bubble_grid"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1)
        assert all(len(r["peak_activation_bytes_per_rank"]) == 2 for r in by.values())
        for r in by.values():  # the ranks' mean idle share counts the slowest rank's idle time and the others'
            assert r["bubble_measured"] >= r["bubble_slowest_rank"]
        speed, base = by["gems"]["vs_1f1b"], by["1f1b"]["bubble_measured"]
        ratio = by["gems"]["bubble_measured"] / base if base > 0 else float("inf")
        mine = [line for line in lines if line.split(" ", 2)[1] == f"{model}:"]
        assert len(mine) == 2 and f"gems {speed:.2f}x 1f1b's samples/s" in mine[0], mine
        assert mine[0].split(" ", 1)[0] in earned(speed >= train_gems.TARGET_SPEEDUP, speed, train_gems.TARGET_SPEEDUP)
        limit = train_gems.TARGET_BUBBLE_RATIO
        assert mine[1].split(" ", 1)[0] in earned(ratio <= limit, ratio, limit), (mine[1], ratio)


def test_branch_quick_bench_places_every_branch_and_compares_with_data_parallel(tmp_path: Path) -> None:
    records, markdown = run("branch", tmp_path)  # no target: it reports where it wins and where it loses
    assert "branch placement (rank of each branch)" in markdown
    batches = sorted({r["batch"] for r in records})
    assert len(batches) >= 2
    for batch in batches:
        mine = [r for r in records if r["batch"] == batch]
        splits = batch % 2 == 0  # dp runs only where the batch splits over the 2 ranks
        names = tuple(c for c in train_branch.CONTENDERS if splits or c != "dp")
        by = timed(mine, names)
        assert by["single"]["vs_single"] == 1.0 and by["single"]["ranks"] == 1
        placement = by["branch"]["placement"]
        assert sorted({rank for rank in placement}) == [0, 1]  # the branches run on both ranks
        assert len(by["branch"]["branch_seconds"]) == len(placement)
