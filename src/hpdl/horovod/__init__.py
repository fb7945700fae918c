"""A Horovod-compatible PyTorch API on hpdl: `import hpdl.horovod as hvd` in place of `import horovod.torch as hvd`.

    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

What differs from Horovod is listed in docs/data_parallel.md.
"""

from hpdl.horovod.ops import *  # noqa: F403
from hpdl.horovod.ops import __all__ as _ops_all
from hpdl.horovod.optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer", *_ops_all]
