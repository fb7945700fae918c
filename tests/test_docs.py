"""Docs that are tests: every fenced block of README.md and docs/*.md that is meant to run runs here, under the
launcher its text names, so that a doc edit that breaks an example fails the suite.

The convention (docs/README.md states it for writers; tests/doc_blocks.py finds and classifies the blocks):

- A block fenced ```python, ```bash or ``` (no language) is code, and runs unless it is marked.
- A block fenced ```text is printed text (output, error messages, usage lines, schedule drawings): never run.
- `<!-- fragment -->` (or `<!-- fragment: why -->`) on the line just before a fence marks incomplete code, that
  uses a `model`, `loader` or `comm` of the text around it, or a command that needs what the suite has not (a
  site's MPI, a `train.py`). A fragment is checked without running it: Python compiles, its imports import,
  a fragment that imports anything imports every module it uses (`torch`, `nn`, ...), and the attribute paths
  of modules (`hpdl.parallel.zero`, `hvd.Compression.fp16`) exist; its `hpdl ...` lines are read by hpdl's
  own argument parsers (dry-parsed: a renamed command or option fails, nothing runs).
- A file: a ```python, ```toml or ```json block just after a line that ends in ':' and names `NAME.py` (or
  .toml, .json) in backticks, as "`allreduce.py`:", or one marked `<!-- file: NAME -->`, is that file. The
  page's files are written into a folder of its own, where its command blocks then run.

How the rest runs:

- A Python block that calls `hpdl.init(` runs on 2 ranks under `hpdl launch -n 2`, the others in one process
  under `python`; each group in ONE job (tests/scripts/run_examples.py runs each block as `__main__`), to pay
  the ranks' start-up once.
- A command block: each line runs in bash in the page's folder, with this Python's bin folder (the venv's
  `hpdl`, `python`, and the mpich wheel's Hydra `mpiexec`/`mpirun`) first on PATH, so under the launcher the
  line names (`hpdl launch`, `mpirun`, `torchrun`, `python`, ...). Except:
  - long benchmarks and jobs another test runs with small sizes (doc_blocks.LONG: `hpdl tune`, `hpdl bench`,
    `hpdl plan calibrate / validate`, the labs of examples/): dry-parsed here; the test that runs them is
    named there and must exist;
  - launchers no CI machine has (doc_blocks.EXCLUDED: `srun`, which needs a Slurm allocation): their lines
    are listed in EXCLUDED_LINES below, and a new one fails until it is listed: a documented exclusion, not a
    skip.
- The README's Quick start: `allreduce.py` runs under every line of its run block, and each line's output
  must show its ranks, its backend (the one the line's comment names) and the right sum.

Cost: 37 s alone on 2 cores, about 37 CPU-s (five launches of the Quick start, one job of 2 ranks, the plan
commands, one process of checks); 107 s beside four other busy jobs.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from doc_blocks import ROOT, Block, Line, all_blocks

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "scripts", "run_examples.py")
BLOCKS = all_blocks()
LINES = [line for block in BLOCKS if block.kind in ("shell", "fragment") for line in block.lines()]

EXCLUDED_LINES = [
    ("README.md", "srun python allreduce.py"),  # the Quick start's Slurm line: no Slurm here
    ("docs/comm.md", "srun -N 2 --ntasks-per-node 4 python train.py"),  # (a fragment: site MPI)
    ("docs/torch_backend.md", "srun -n 4 python train.py"),  # (a fragment: train.py)
]
"""Every line whose launcher no CI machine has (doc_blocks.EXCLUDED), by page and command without comment."""


def _id(item: Any) -> str:
    return str(item.id)


def _environment() -> dict[str, str]:
    bin_dir = os.path.dirname(sys.executable)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --------------------------------------------------------------------------- every block is accounted for


def test_every_block_is_code_that_runs_text_or_marked():
    problems = []
    for block in BLOCKS:
        if block.kind == "unknown":
            problems.append(f"{block.id} (line {block.line}): a ```{block.language} block that is no file: name it")
        if block.kind == "file" and block.name:
            used = [line for line in LINES if line.block.doc == block.doc and block.name in line.text]
            if not any(line.action == "run" for line in used):
                problems.append(f"{block.id}: `{block.name}` is run by no command of {block.doc}")
        if block.language == "python" and block.kind != "text":
            try:
                compile(block.code, block.id, "exec")
            except SyntaxError as error:
                problems.append(f"{block.id}: {error}")
    for line in LINES:
        if line.action == "run" and "[" in line.shell_text().split("#")[0]:
            problems.append(f"{line.id}: `{line.text}` has a placeholder: mark the block <!-- fragment -->")
    assert not problems, "\n".join(problems)


def test_the_lines_not_run_for_want_of_a_launcher_are_the_documented_ones():
    excluded = [(line.block.doc, " ".join(line.argv)) for line in LINES if line.action == "excluded"]
    assert excluded == EXCLUDED_LINES


# --------------------------------------------------------------------------- checked without running


@pytest.fixture(scope="module")
def checked() -> dict[str, list[str]]:
    """The fragments' and the dry-parsed lines' problems, from one process of their own (doc_blocks.py)."""
    done = subprocess.run(
        [sys.executable, os.path.join(HERE, "doc_blocks.py"), ROOT],
        capture_output=True,
        text=True,
        timeout=300,
        env=_environment(),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "fragment" and b.language == "python"], ids=_id)
def test_fragment_compiles_and_names_what_exists(block: Block, checked: dict[str, list[str]]):
    assert checked[block.id] == [], f"{block.id} (line {block.line}):\n" + "\n".join(checked[block.id])


@pytest.mark.parametrize("line", [line for line in LINES if line.action == "dry-parse"], ids=_id)
def test_command_not_run_here_is_read_by_its_parser(line: Line, checked: dict[str, list[str]]):
    assert checked[line.id] == [], "\n".join(checked[line.id])
    covered = line.covered_by()
    if covered is not None:  # a long command: the test that runs it (smaller) exists and says it does
        test, evidence, _ = covered
        assert evidence in Path(ROOT, test).read_text(), f"{test} no longer runs `{line.text}` ({evidence})"


# --------------------------------------------------------------------------- Python blocks, run


SCRIPTS = [block for block in BLOCKS if block.kind in ("script-ranks", "script-python")]


@pytest.fixture(scope="module")
def script_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every script block, run: those on ranks in one `hpdl launch -n 2` job, the rest in one `python` run.
    block id -> the output of its ranks (rank 0's first), or the job's output when the block did not run."""
    out = tmp_path_factory.mktemp("doc-scripts")
    outputs = {}
    jobs: list[tuple[str, list[str], int]] = [
        ("script-ranks", [sys.executable, "-m", "hpdl.cli.main", "launch", "-n", "2"], 2),
        ("script-python", [sys.executable], 1),
    ]
    for kind, launcher, ranks in jobs:
        group = [block for block in SCRIPTS if block.kind == kind]
        names = [re.sub(r"\W", "_", block.id) for block in group]
        for name, block in zip(names, group):
            (out / f"{name}.py").write_text(block.code)
        plan = [[name, str(out / f"{name}.py"), []] for name in names]
        if not plan:
            continue
        done = subprocess.run(
            [*launcher, RUNNER, str(out), json.dumps(plan)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=out,
            env=_environment(),
        )
        for name, block in zip(names, group):
            files = [out / f"{name}.{rank}.out" for rank in range(ranks)]
            if done.returncode == 0 and all(f.exists() for f in files):
                outputs[block.id] = "".join(f.read_text() for f in files)
            else:
                outputs[block.id] = f"(did not run: exit {done.returncode})\n{done.stdout}{done.stderr}"
    return outputs


@pytest.mark.parametrize("block", SCRIPTS, ids=_id)
def test_python_block_runs(block: Block, script_outputs: dict[str, str]):
    assert not script_outputs[block.id].startswith("(did not run"), script_outputs[block.id]


def test_the_gpt_layout_the_hybrid_page_prints_is_the_models():
    from hpdl.models.gpt import TP_PLAN

    (block,) = [b for b in BLOCKS if b.doc == "docs/hybrid.md" and "embed.tok" in b.code and b.kind != "fragment"]
    assert eval(block.code) == TP_PLAN  # a dict literal: the block's only code


# --------------------------------------------------------------------------- command lines, run


@pytest.fixture(scope="module")
def page_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A folder per page, holding the page's files (its named blocks)."""
    folders = {}
    for doc in sorted({block.doc for block in BLOCKS}):
        folder = folders[doc] = tmp_path_factory.mktemp(re.sub(r"\W", "_", doc))
        for block in BLOCKS:
            if block.doc == doc and block.kind == "file" and block.name:
                (folder / block.name).write_text(block.code)
    return folders


@pytest.mark.parametrize("line", [line for line in LINES if line.action == "run"], ids=_id)
def test_command_line_runs(line: Line, page_folders: dict[str, Path]):
    env = _environment()
    env["PET_MASTER_PORT"] = str(_free_port())  # torchrun's --master-port, not 29500 beside other tests
    done = subprocess.run(
        ["bash", "-c", line.shell_text()],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=page_folders[line.block.doc],
        env=env,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"`{line.text}` exited {done.returncode}:\n{output}"
    if "allreduce.py" in line.argv:
        _check_quick_start(line, done.stdout)


def _check_quick_start(line: Line, output: str) -> None:
    """The README's allreduce.py: N ranks (the line's -n/-np/--nproc-per-node, else 1), on the backend the
    line's comment names, each holding the sum of the ranks, 0 + 1 + ... + N-1."""
    argv = line.argv
    size = 1
    for flag in ("-n", "-np", "--nproc-per-node"):
        if flag in argv:
            size = int(argv[argv.index(flag) + 1])
    comment = line.text.split("#", 1)[1] if "#" in line.text else ""
    named = re.search(r"\bthe (mpi|torch|self) backend|\bover (MPI|torch\.distributed)", comment)
    assert named, f"the comment of `{line.text}` names no backend"
    backend = named.group(1) or {"MPI": "mpi", "torch.distributed": "torch"}[named.group(2)]
    total = float(sum(range(size)))
    found = sorted(re.findall(r"rank (\d+) of (\d+) \((\w+)\): \[([^\]]*)\]", output))
    assert [(int(r), int(n), b) for r, n, b, _ in found] == [(r, size, backend) for r in range(size)], output
    assert all([float(v) for v in values.split(",")] == [total] * 4 for *_, values in found), output
