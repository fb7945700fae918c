"""Run Horovod's own TensorFlow suite against hpdl.tensorflow, outside this repository (issue 52, item 5).

    python tests/scripts/horovod_tf_suite.py /path/to/horovod-git-dir [--ranks 2 3] [--tests test_tensorflow.py]

It writes a temporary folder with Horovod's test files (read from the git directory with `git show`, never
changed) and a small re-exporting `horovod` package: `horovod.tensorflow` is `hpdl.tensorflow`,
`horovod.tensorflow.keras` is `hpdl.keras` when that exists, `horovod.runner.util.threads.in_thread` and a
`mock` module and `horovod.common.util.is_version_greater_equal_than` are the helpers Horovod's test utilities
import (`horovod.keras` is `hpdl.keras` too). Its Keras file needs `pip install parameterized` (not a project
dependency). Each file runs under
`mpiexec -n K python -m pytest` from that folder; the counts of every rank are printed, and each failure's
reason is read from rank 0's report.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time

SHIM = {
    "horovod/__init__.py": '"""A shim: Horovod\'s names re-exported from hpdl (for running Horovod\'s tests)."""\n',
    "horovod/tensorflow/__init__.py": (
        "from hpdl.tensorflow import *  # noqa: F401,F403\n"
        "from hpdl.tensorflow import __all__, _allreduce, _grouped_allreduce, _executing_eagerly  # noqa: F401\n"
        "from hpdl.tensorflow import util  # noqa: F401\n"
        "try:\n"
        "    from hpdl.tensorflow import SyncBatchNormalization  # noqa: F401\n"
        "except ImportError:\n"
        "    pass\n"
    ),
    "horovod/tensorflow/util.py": "from hpdl.tensorflow.util import *  # noqa: F401,F403\n"
    "from hpdl.tensorflow.util import _executing_eagerly  # noqa: F401\n",
    "horovod/tensorflow/keras/__init__.py": "from hpdl.keras import *  # noqa: F401,F403\n",
    "horovod/runner/__init__.py": "",
    "horovod/runner/util/__init__.py": "",
    "horovod/runner/util/threads.py": (
        "import threading\n\n\n"
        "def in_thread(target, args=(), name=None, daemon=True, silent=False):\n"
        "    thread = threading.Thread(target=target, args=args, name=name, daemon=daemon)\n"
        "    thread.start()\n"
        "    return thread\n"
    ),
    "mock.py": "from unittest.mock import *  # noqa: F401,F403\n\nversion_info = (5, 1, 0)  # parameterized reads it\n",
    "horovod/keras/__init__.py": "from hpdl.keras import *  # noqa: F401,F403\n",
    "horovod/common/__init__.py": "",
    "horovod/common/util.py": (
        "from packaging import version\n\n\n"
        "def is_version_greater_equal_than(ver, target):\n"
        "    return version.parse(ver) >= version.parse(target)\n"
    ),
}

FILES = ["test/parallel/base_test_tensorflow.py", "test/utils/common.py"]


def git_show(git_dir: str, path: str) -> str:
    return subprocess.run(
        ["git", f"--git-dir={git_dir}", "show", f"HEAD:{path}"], check=True, capture_output=True, text=True
    ).stdout


def build(git_dir: str, tests: list[str], where: str) -> None:
    for rel, text in SHIM.items():
        path = os.path.join(where, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as handle:
            handle.write(text)
    os.makedirs(os.path.join(where, "test", "parallel"), exist_ok=True)
    os.makedirs(os.path.join(where, "test", "utils"), exist_ok=True)
    for rel in FILES + [f"test/parallel/{t}" for t in tests]:
        with open(os.path.join(where, rel), "w") as handle:
            handle.write(git_show(git_dir, rel))


def run(where: str, test: str, nranks: int, timeout: float) -> tuple[str, float]:
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    env = dict(os.environ, PYTHONPATH=where, TF_CPP_MIN_LOG_LEVEL="2", OMP_NUM_THREADS="1")
    start = time.perf_counter()
    # Each rank writes its own report (interleaved on one stream, the summary lines were lost).
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", "-rfEs",
              "--tb=short", os.path.join("test", "parallel", test)]  # fmt: skip
    logs = [os.path.join(where, f"{test}.{nranks}.rank{r}.log") for r in range(nranks)]
    script = f'exec {" ".join(pytest)} > "{where}/{test}.{nranks}.rank$PMI_RANK.log" 2>&1'
    try:
        subprocess.run([mpiexec, "-n", str(nranks), "sh", "-c", script], cwd=where, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    seconds = time.perf_counter() - start
    texts = []
    for r, path in enumerate(logs):
        with open(path) as handle:
            texts.append(f"--- rank {r}\n" + handle.read())
    return "\n".join(texts), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("git_dir", help="a git directory of horovod/horovod (e.g. a bare mirror)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--tests", nargs="+", default=["test_tensorflow.py"])
    parser.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args()
    where = tempfile.mkdtemp(prefix="hpdl-horovod-tf-")
    build(args.git_dir, args.tests, where)
    print(f"suite folder: {where}", flush=True)
    for test in args.tests:
        for k in args.ranks:
            output, seconds = run(where, test, k, args.timeout)
            summaries = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|error).*) in [\d.]+s", output, re.M)
            print(f"\n## {test} on {k} ranks ({seconds:.0f} s): " + " | ".join(summaries), flush=True)
            rank0 = output.split("--- rank 1")[0]
            failed = re.findall(r"^(?:FAILED|ERROR|SUBFAILED\[(\w+)\]) \S+::(\w+)", rank0, re.M)
            modes = collections.Counter(mode or "test" for mode, _ in failed)
            print(f"  rank 0: failed {dict(modes) or 0} (TensorFlow's test framework runs each test in a TF1 "
                  "graph and eagerly: one sub-test per mode)")  # fmt: skip
            for block in re.split(r"^_+ (?=\S)", rank0, flags=re.M)[1:]:
                title = block.split("\n", 1)[0].strip(" _")
                errors = [line for line in block.splitlines() if line.startswith("E   ") and line.strip() != "E"]
                if title.startswith("TensorFlow") or errors:
                    print(f"  FAILED {title}: {errors[0][4:][:300] if errors else '?'}")
    print(f"(every rank's report: {where}/<test>.<ranks>.rank<r>.log)")


if __name__ == "__main__":
    main()
