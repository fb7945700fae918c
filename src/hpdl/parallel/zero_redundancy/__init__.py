"""ZeRO (the Zero Redundancy Optimizer), stages 1, 2 and 3: shard optimizer state, gradients and parameters.

    model, optimizer = hpdl.parallel.zero(model, comm, stage=2, optimizer=torch.optim.AdamW, lr=1e-3)

The package is named `zero_redundancy`, not `zero`, so that
`hpdl.parallel.zero` is always the function: a package of that name would
be bound over it by the import system. One module per job:

- `wrap`: `zero()`, `ZeroModel`, `ZeroOptimizer`, clipping, `memory_formula`;
- `partition`: units of parameters split evenly over the ranks, by bytes;
- `units`: each unit's flat buffers (parameters, gradients, fp32 masters);
- `reduce`: stage 2/3 gradient reduce-scatter per unit during backward;
- `stage3`: stage 3's gather-on-demand, free-after-use and prefetch of the next unit;
- `checkpointing`: what a rank writes to and reads from `hpdl.checkpoint`.
"""

from hpdl.parallel.zero_redundancy.stage3 import WrapPolicy
from hpdl.parallel.zero_redundancy.wrap import ZeroModel, ZeroOptimizer, clip_zero_grad_norm_, memory_formula, zero

__all__ = ["zero", "ZeroModel", "ZeroOptimizer", "memory_formula", "clip_zero_grad_norm_", "WrapPolicy"]
