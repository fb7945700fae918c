"""Smoke test of `hpdl bench torch --quick`: the same DDP and FSDP2 code on hpdl and gloo, end to end on 2 ranks.

It checks what does not depend on timing: every contender ran, DDP on hpdl and hpdl's DataParallel end with
gloo's parameters, the reference rows carry no parameter comparison (they train without exchanging
gradients), and the latency table has every size; never the speeds (benchmarks are not tests).
"""

from __future__ import annotations

import json
from pathlib import Path

from hpdl.bench import torch_backend


def test_quick_bench_runs_every_contender_and_ddp_on_hpdl_ends_where_gloo_does(tmp_path: Path) -> None:
    assert torch_backend.launch(["--quick", "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "torch.json").read_text())
    markdown = (tmp_path / "torch.md").read_text()
    ddp = {r["contender"]: r for r in records if r["part"] == "ddp"}
    assert set(ddp) == {"ddp-hpdl", "ddp-gloo", "hpdl DataParallel", torch_backend.CEILING, torch_backend.DDP_ALONE}
    for name in ("ddp-hpdl", "hpdl DataParallel"):
        assert ddp[name]["max_param_diff_vs_ddp_gloo"] <= 1e-6, ddp[name]
    for name in (torch_backend.CEILING, torch_backend.DDP_ALONE):
        assert ddp[name]["max_param_diff_vs_ddp_gloo"] is None
    assert all(r["samples_per_s"]["median"] > 0 for r in records if r["part"] in ("ddp", "fsdp"))
    assert {r["contender"] for r in records if r["part"] == "fsdp"} == {"fsdp2-hpdl", "fsdp2-hpdl-pooled", "fsdp2-gloo"}
    sizes = {r["bytes"] for r in records if r["part"] == "allreduce"}
    assert len(sizes) >= 3 and 4 in sizes
    assert "## Targets" in markdown and "the most any backend could reach" in markdown
    assert "FSDP2 on hpdl with its buffers from the group's pool" in markdown
