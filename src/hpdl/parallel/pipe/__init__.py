"""Pipeline parallelism: `Pipeline` (the front, in `pipeline`) and its parts, one job per module.

`hpdl.parallel.Pipeline` is the public entry; the other modules are: `schedule` (who runs which micro-batch
when), `microbatch` (splitting batches), `balance` (measured costs and the
partition), `p2p` (activations and gradients between neighbours, errors
too), `engine` (runs one stage's actions), `memory` (an activation meter), and `gems_schedule` / `gems` (GEMS-MASTER:
two mirrored replicas on the same ranks).
"""

from __future__ import annotations

from hpdl.parallel.pipe.errors import BalanceError, PipelineError, StageFailedError
from hpdl.parallel.pipe.gems import GemsPipeline  # registers schedule="gems" with Pipeline
from hpdl.parallel.pipe.pipeline import Pipeline

__all__ = ["Pipeline", "GemsPipeline", "PipelineError", "StageFailedError", "BalanceError"]
