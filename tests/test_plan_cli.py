"""`hpdl plan` as a user runs it: memory, search (reference and user models), calibrate, validate --quick.

The lab runs in tests/test_examples.py, with the other examples.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hpdl(*args: str, timeout: float = 240, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "hpdl.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
    return done


def plan_cli(capsys, *args: str) -> tuple[int, str, str]:
    """`hpdl plan ARGS` in this process (the same function the command calls)."""
    from hpdl.cli.plan import run_argv

    code = run_argv(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_memory_reproduces_the_zero_paper_in_text_and_json(capsys):
    args = ["plan", "memory", "--params", "7.5e9", "--dp", "64", "--optimizer", "adam", "--precision", "mixed"]
    _, text, _ = plan_cli(capsys, *args[1:], "--pp", "4", "--micro-batches", "8")
    rows = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in text.splitlines() if "|" in line}
    assert (rows["DP"], rows["ZeRO-1"], rows["ZeRO-2"], rows["ZeRO-3"]) == ("120.0", "31.4", "16.6", "1.875")
    assert "3/11" in text  # GPipe bubble (p-1)/(m+p-1) for p=4, m=8
    code, out, _ = plan_cli(capsys, *args[1:], "--json")
    data = json.loads(out)
    assert code == 0 and [r["total_GB"] for r in data["rows"]] == [120.0, 31.40625, 16.640625, 1.875]


def test_search_of_a_reference_model_on_an_inline_cluster_writes_a_plan_file(tmp_path, capsys):
    from hpdl.parallel.mesh.plan_config import Plan

    out = tmp_path / "plan.toml"
    cluster = "nodes=4,gpus_per_node=8,gpu=a100-40,intra=nvlink,inter=ib-200"
    code, text, _ = plan_cli(capsys, "--model", "gpt2-large", "--batch", "256", "--cluster", cluster, "--json",
                             "--out", str(out))  # fmt: skip
    data = json.loads(text)
    assert data["devices"] == 32 and data["feasible"] > 0 and data["candidates"] >= data["feasible"]
    best = data["best"]
    assert best["dp"] * best["pp"] * best["tp"] == 32 and best["fits"]
    parts = ("compute_s", "tp_comm_s", "p2p_s", "bubble_s", "dp_comm_s", "optimizer_s")
    assert sum(best[k] for k in parts) == pytest.approx(best["step_s"])
    plan = Plan.from_file(str(out))
    assert (plan.dp, plan.pp, plan.tp, plan.zero_stage) == (best["dp"], best["pp"], best["tp"], best["zero_stage"])
    assert plan.validate(world_size=32) is not None


def test_search_table_says_why_the_best_wins(capsys):
    cluster = "nodes=4,gpus_per_node=8,gpu=a100-40,intra=nvlink,inter=ib-200"
    code, text, _ = plan_cli(capsys, "--model", "gpt2-large", "--batch", "256", "--cluster", cluster, "--top", "3")
    assert code == 0 and "| #" in text and "Best: " in text and "slower" in text
    # the header's two counts say what they count (it read "38 layers" beside "layers=36")
    assert "(38 layers to place in stages: embedding + 36 x block + head;" in text and "blocks=36," in text, text


def test_search_of_a_user_model_file_and_clear_errors(tmp_path, capsys):
    model = tmp_path / "mymodel.py"
    model.write_text(
        "import torch\n"
        "def make_model():\n"
        "    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])\n"
        "def example_input(batch):\n"
        "    return torch.randn(batch, 256)\n"
    )
    code, out, _ = plan_cli(capsys, "--model", f"{model}:make_model", "--batch", "64", "--cluster", "h100",
                            "--precision", "fp32", "--json")  # fmt: skip
    data = json.loads(out)
    assert code == 0 and data["model"]["params"] == 6 * (256 * 256 + 256)
    assert data["best"]["tp"] == 1  # no tp_plan on the model: the planner does not split its layers
    code, _, err = plan_cli(capsys, "--model", "nosuchmodel", "--batch", "8", "--cluster", "h100")
    assert code == 2 and "not a reference model" in err
    code, _, err = plan_cli(capsys, "--model", f"{model}:nothing", "--batch", "8", "--cluster", "h100")
    assert code == 2 and "no callable 'nothing'" in err
    code, _, err = plan_cli(capsys, "--model", "gpt2", "--batch", "8", "--cluster", "gpu=tpu")
    assert code == 2 and "unknown gpu" in err
    code, _, err = plan_cli(capsys, "--model", "gpt2", "--batch", "8", "--cluster", "h100", "--devices", "16")
    assert code == 2 and "the cluster has 8" in err


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """`hpdl plan calibrate --quick` (in this process; its collective probe runs on 2 real MPI ranks)."""
    from hpdl.cli.plan import run_argv

    path = tmp_path_factory.mktemp("cluster") / "cluster.toml"
    assert run_argv(["calibrate", "--quick", "--devices", "2", "--out", str(path)]) == 0
    return path


def test_calibrate_measures_this_machine_and_writes_a_cluster_file(calibrated):
    from hpdl.plan.cluster import load_cluster_file

    cluster = load_cluster_file(str(calibrated))
    assert cluster.devices == 2 and cluster.nodes == 1
    assert cluster.flops["fp32"] > 1e8 and cluster.node_flops and cluster.node_flops["fp32"] >= cluster.flops["fp32"]
    assert 0 < cluster.intra.latency_s < 1e-2 and cluster.intra.bandwidth_Bps > 1e7
    assert "direct probe" in cluster.extra["collectives"] and "measured on" in cluster.source


@pytest.fixture(scope="module")
def validated(calibrated, tmp_path_factory):
    """`hpdl plan validate --quick` of the MLP, the CNN and the inception block, once for the tests below (each
    world size's ranks start once for all three): its output folder and what it printed."""
    out = tmp_path_factory.mktemp("validate")
    done = hpdl("plan", "validate", "--quick", "--models", "mlp", "cnn", "inception", "--cluster", str(calibrated),
                "--out", str(out), timeout=600)  # fmt: skip
    return out, done.stdout


def test_validate_quick_measures_the_spatial_plans_of_a_cnn_and_the_branch_plans_of_an_inception_block(validated):
    out, stdout = validated
    assert "predicted ms" in stdout
    records = [r for r in json.loads((out / "validate.json").read_text())["records"] if r["model"] != "mlp"]
    assert not [r for r in records if r["error"]], [r["error"] for r in records if r["error"]]
    ran = [r for r in records if r["measured_s"]]
    assert len(ran) == len(records)
    on_two = {(r["model"], r["fields"]["dp"], r["fields"].get("sp", 1), r["fields"].get("pp", 1), r["fields"]["tp"])
              for r in ran if r["ranks"] == 2}  # fmt: skip
    assert {("cnn", 1, 2, 1, 1), ("cnn", 2, 1, 1, 1)} <= on_two, on_two  # spatial 2-way beside data parallel
    assert ("inception", 1, 1, 1, 2) in on_two, on_two  # the block's branches on 2 ranks (BranchParallel)
    assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in ran)


def test_validate_quick_runs_plans_with_the_real_strategies(validated):
    out, stdout = validated
    assert "predicted ms" in stdout and "measured ms" in stdout
    data = json.loads((out / "validate.json").read_text())
    everything = data["records"]
    records = [r for r in everything if r["model"] == "mlp"]
    assert {r["ranks"] for r in records} == {1, 2}
    ran = [r for r in records if r["measured_s"]]
    assert not [r for r in records if r["error"]], [r["error"] for r in records if r["error"]]
    assert len(ran) == len(records) >= 5  # every feasible plan ran: dp, ZeRO 1-3, pipeline, tensor parallel
    layouts = {(r["fields"]["dp"], r["fields"]["pp"], r["fields"]["tp"]) for r in ran}
    assert {(2, 1, 1), (1, 2, 1), (1, 1, 2)} <= layouts
    for r in ran:
        assert (
            r["predicted_s"] > 0
            and r["measured_s"] > 0
            and r["ratio"] == pytest.approx(r["predicted_s"] / r["measured_s"])
        )
    # Whether >= 80% of predictions land within 25% is measured on a quiet machine, not asserted on a shared CI
    # box; asserted here: the flags, the share and the per-group verdicts follow the records' own numbers, and the
    # report lists every plan with its predicted and measured time.
    for r in ran:
        assert r["within_25"] == (abs(r["predicted_s"] - r["measured_s"]) <= 0.25 * r["measured_s"])
    measured = [r for r in everything if r["measured_s"]]
    assert data["within_25_share"] == pytest.approx(sum(r["within_25"] for r in measured) / len(measured))
    assert {g["ranks"] for g in data["groups"]} == {1, 2}
    for g in data["groups"]:
        mine = [r for r in measured if (r["model"], r["ranks"]) == (g["model"], g["ranks"])]
        assert g["plans"] == len(mine)
        assert g["predicted_best"] == min(mine, key=lambda r: r["predicted_s"])["plan"]
        assert g["measured_best"] == min(mine, key=lambda r: r["measured_s"])["plan"]
    cells = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in (out / "validate.md").read_text().splitlines()
    ]
    table = sorted(tuple(row[:5]) for row in cells if len(row) == 8 and row[0] == "mlp")
    want = [(r["model"], str(r["ranks"]), r["plan"], f"{r['predicted_s'] * 1e3:.2f}", f"{r['measured_s'] * 1e3:.2f}")
            for r in records]  # fmt: skip
    assert table == sorted(want)
    assert (out / "validate.png").stat().st_size > 1000
