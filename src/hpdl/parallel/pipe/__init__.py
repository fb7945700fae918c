"""Pipeline parallelism's parts: schedules, micro-batches, balance, point-to-point links and the step engine.

`hpdl.parallel.Pipeline` (in `hpdl.parallel.pipeline`) is the public entry;
the modules here are one job each: `schedule` (who runs which micro-batch
when), `microbatch` (splitting batches), `balance` (measured costs and the
partition), `p2p` (activations and gradients between neighbours, errors
too), `engine` (runs one stage's actions) and `memory` (an activation meter).
"""

from __future__ import annotations

__all__: list[str] = []
