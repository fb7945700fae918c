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


def has_targets(markdown: str) -> bool:
    return "## Targets" in markdown and ("PASS" in markdown or "MISS" in markdown)


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
    assert "output_error" in peer and "torch _tp_conv" in markdown and has_targets(markdown)


def test_gems_quick_bench_runs_every_schedule_with_gems_grid_free_of_bubbles(tmp_path: Path) -> None:
    records, markdown = run("gems", tmp_path)
    assert has_targets(markdown)
    for model in ("act", "mlp"):
        by = timed([r for r in records if r["model"] == model], train_gems.CONTENDERS)
        assert by["gems"]["bubble_grid"] == 0.0  # on 2 ranks the two mirrored replicas fill each other's bubble
        assert by["1f1b"]["bubble_grid"] == by["gpipe"]["bubble_grid"] == pytest.approx(1 / 5)  # (p-1)/(m+p-1)
        assert all(len(r["peak_activation_bytes_per_rank"]) == 2 for r in by.values())
        for r in by.values():  # the ranks' mean idle share counts the slowest rank's idle time and the others'
            assert r["bubble_measured"] >= r["bubble_slowest_rank"]


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
