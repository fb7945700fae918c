"""The suite's xdist scheduling (file_groups.py) on a small suite of its own, in a pytest run of its own: a worker
that dies costs its one test, the run goes on to the end, and a group's files share a worker."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent

FILES = {
    "conftest.py": f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})

        def pytest_xdist_make_scheduler(config, log):
            from file_groups import FileGroups
            return FileGroups(config, log, {{"test_pool_a.py": "pool", "test_pool_b.py": "pool"}})
        """,
    # the worker dies in the middle of a file: the test after it still runs, on another worker
    "test_dies_midway.py": """
        import os
        def test_before(): pass
        def test_dies(): os._exit(3)
        def test_after(): pass
        """,
    # the last unit of all is a single test that kills its worker: the run still ends
    "test_zz_dies_alone.py": """
        import os
        def test_dies_alone(): os._exit(3)
        """,
    "test_pool_a.py": "def test_a1(): pass\ndef test_a2(): pass\n",
    "test_pool_b.py": "def test_b1(): pass\n",
    "test_plain.py": "import time\ndef test_p1(): time.sleep(0.2)\ndef test_p2(): pass\n",
}


def test_a_dying_worker_costs_its_test_and_the_run_ends(tmp_path: Path) -> None:
    for name, text in FILES.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "-v", "-p", "no:cacheprovider", "."],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "2 failed, 7 passed" in out, out  # xdist 3.8's own file scheduling: runs test_dies again, then hangs
    assert "crashed while running 'test_dies_midway.py::test_dies'" in out, out
    assert re.search(r"PASSED test_dies_midway.py::test_after", out), out
    workers = {test: worker for worker, test in re.findall(r"\[(gw\d+)\] \[\s*\d+%\] PASSED test_pool_(\w)", out)}
    assert workers.keys() == {"a", "b"} and workers["a"] == workers["b"], out
