"""test_keras_ranks.py's job on 4 ranks (KERAS_BACKEND=torch): data parallel on a process set of 3 ranks against
one process, then a Keras model as a dp x pp = 2 x 2 pipeline against one process. Each rank writes its results
to <folder>/rank<r>.json."""

import json
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the bodies

import hpdl  # noqa: E402
from test_keras import dp_fit_body, pipeline_body  # noqa: E402

comm = hpdl.init()
result = {
    "dp3": dp_fit_body(comm, "float64", False, members=[0, 1, 2]),
    "dp3_eager": dp_fit_body(comm, "float32", True, members=[0, 1, 2]),
    "dpxpp": pipeline_body(comm, "1f1b", 3, 2),
}
with open(os.path.join(sys.argv[1], f"rank{comm.rank}.json"), "w") as handle:
    json.dump(result, handle)
hpdl.finalize()
