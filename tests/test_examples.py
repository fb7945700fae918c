"""The examples run under `hpdl launch -n 2` and reach their stated results.

The MPI examples run one after another in one job (tests/scripts/run_examples.py: each as `__main__` with its
own arguments, initialising and finalizing hpdl itself), so that they share the ranks' start-up: nine
examples took 97 + 58 CPU-s in nine launches and take 54 CPU-s in one. The Horovod and torch.distributed
ones, which set up process-wide state of their own, run alone as a user runs them. `hpdl launch` itself (the
forms, exit codes, output) is tested in tests/test_launcher.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
SHARED = {
    "train_digits.py": ["--epochs", "10"],
    "lab_data_parallel.py": [],
    "lab_spatial.py": ["--steps", "3"],
    "lab_gems.py": ["--steps", "20"],
    "lab_branch.py": ["--steps", "40"],
    "lab_pipeline.py": ["--steps", "25", "--batch", "8"],
    "lab_zero.py": ["--epochs", "2", "--out", "{out}/zero-ckpt"],
    "lab_ml.py": ["--out", "{out}/lab_ml.png"],
    "lab_plan.py": [],
}
"""The examples of the shared job, with their arguments ({out}: the job's output folder)."""


def launch(script: str, *args: str, timeout: float = 240) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "hpdl.cli.main", "launch", "-n", "2", os.path.join(EXAMPLES, script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared job's output folder ({out} in SHARED)."""
    return tmp_path_factory.mktemp("examples")


@pytest.fixture(scope="module")
def shared(shared_dir: Path) -> dict[str, str]:
    """Every example of SHARED, run in one job: name -> the standard output of both ranks (rank 0's first)."""
    out = shared_dir
    plan = [[name, os.path.join(EXAMPLES, name), [a.format(out=out) for a in args]] for name, args in SHARED.items()]
    launch_output = launch(os.path.join(HERE, "scripts", "run_examples.py"), str(out), json.dumps(plan), timeout=600)
    outputs = {}
    for name in SHARED:
        files = [out / f"{name}.{rank}.out" for rank in (0, 1)]
        assert all(f.exists() for f in files), f"{name} did not run: {launch_output}"
        outputs[name] = "".join(f.read_text() for f in files)
    return outputs


def shared_output(shared: dict[str, str], script: str, *args: str) -> str:
    assert list(args) == SHARED[script]  # the arguments the shared job ran it with
    return shared[script]


@pytest.mark.parametrize("script", ["train_digits.py", "train_digits_horovod.py"])
def test_digits_examples_reach_the_demo_accuracy(script, request):
    if script in SHARED:
        output = shared_output(request.getfixturevalue("shared"), script, "--epochs", "10")
    else:
        output = launch(script, "--epochs", "10")
    accuracies = [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", output)]
    assert accuracies and accuracies[-1] >= 0.95, output


def test_lab_runs_and_checks_its_claims(shared):
    output = shared_output(shared, "lab_data_parallel.py")
    # The lab asserts its claims itself; here: both ranks printed them, and they held.
    assert output.count("(equal to the mean of the local ones: True)") == 2, output
    assert output.count("(same: True)") == 2, output
    assert "False" not in output, output


def test_torch_backend_lab_runs_ddp_on_gloo_and_hpdl_with_equal_parameters():
    output = launch("lab_torch_backend.py", "--steps", "10")
    assert output.count("(same: True)") == 2, output
    assert output.count("DDP on hpdl:") == 2 and output.count("DDP on gloo:") == 2, output


def test_spatial_lab_trains_on_slabs_like_one_process(shared):
    output = shared_output(shared, "lab_spatial.py", "--steps", "3")
    assert output.count("(same: True)") == 2, output
    assert output.count("holds it: True") == 2 and output.count("(falls: True)") == 2, output
    assert "False" not in output, output


def test_gems_lab_fills_the_bubble_and_matches_one_process(shared):
    output = shared_output(shared, "lab_gems.py", "--steps", "20")
    assert "at most half: True" in output, output
    assert output.count("(same: True)") == 2 and output.count("(fell: True)") == 2, output
    assert output.count("ran exactly the schedule: True") == 2, output


def test_branch_lab_places_branches_and_matches_one_process(shared):
    output = shared_output(shared, "lab_branch.py", "--steps", "40")
    assert output.count("stem grad equal: True") == 2, output
    assert output.count("(same: True)") == 2 and output.count("(fell: True)") == 2, output


def test_pipeline_lab_trains_and_checks_its_claims(shared):
    output = shared_output(shared, "lab_pipeline.py", "--steps", "25", "--batch", "8")
    assert output.count("(fell: True); same on every rank: True") == 2, output
    assert re.search(r"rank 0: peak 2 <= 2 <= stages 2: True", output), output


def test_zero_lab_trains_an_over_budget_model_and_reshards(shared):
    output = shared_output(shared, "lab_zero.py", "--epochs", "2", "--out", "{out}/zero-ckpt")
    assert output.count("(fits the budget: True)") == 2, output
    assert output.count("stage 3 -> stage 1 on 2 ranks: same predictions (same: True)") == 2, output
    assert "one plain process (epochs 2): same predictions (same: True); consolidated export (same: True)" in output


def test_ml_lab_runs_and_checks_its_claims(shared, shared_dir):
    output = shared_output(shared, "lab_ml.py", "--out", "{out}/lab_ml.png")
    assert output.count("(same as scikit-learn: True)") == 4, output
    assert "(same as on the ranks: True)" in output and "False" not in output, output
    assert (shared_dir / "lab_ml.png").stat().st_size > 10_000


def test_plan_lab_plans_a_far_cluster_and_runs_the_chosen_plan_here(shared):
    output = shared_output(shared, "lab_plan.py")
    assert "== 1. GPT-2 XL" in output and "Best: " in output
    assert "predicted" in output and "measured" in output
    assert output.count("ratio") >= 1
