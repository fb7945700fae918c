"""Run several examples one after another in the ranks of one job, each as `python example.py ARGS` runs it.

    hpdl launch -n 2 run_examples.py OUT_DIR '[["name", "/path/example.py", ["--steps", "3"]], ...]'

Each example runs as `__main__` with its own argv and its folder first on sys.path, and initialises and
finalizes hpdl itself; its standard output goes to OUT_DIR/NAME.RANK.out. tests/test_examples.py launches
this once, so that the examples share the ranks' start-up (importing torch, MPI_Init: about 5 CPU-s per rank
and launch) instead of paying it once each. An example that raises ends the job, as under `hpdl launch`; one
that ends with `sys.exit(0)` (the demo's worker, src/hpdl/train/demo.py, runs here too) has succeeded.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys

import hpdl


def main() -> None:
    out_dir, plan = sys.argv[1], json.loads(sys.argv[2])
    rank = hpdl.init().rank
    hpdl.finalize()
    for name, script, args in plan:
        with open(os.path.join(out_dir, f"{name}.{rank}.out"), "w") as out, contextlib.redirect_stdout(out):
            sys.argv = [script, *args]
            sys.path.insert(0, os.path.dirname(script))
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as stop:  # `sys.exit(0)` at the end of a script (hpdl.train.demo's) is success
                if stop.code not in (None, 0):
                    raise
            finally:
                sys.path.pop(0)
                sys.stdout.flush()


if __name__ == "__main__":
    main()
