"""The `hpdl.horovod` contender of `hpdl bench train --strategy dp`: the script a Horovod user writes.

    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

on `import hpdl.horovod as hvd`, over the MPI world (with the same bucket
size as the DataParallel contenders, so the two differ only in the API).
Targets: within 5% of hpdl-mpi's samples/s (the API costs nothing on the
hot path), and at least 1.2x PyTorch DDP over gloo.
"""

from __future__ import annotations

from typing import Any, Callable

from hpdl.bench import report
from hpdl.bench.strategy_harness import faster

__all__ = ["horovod_contender", "verdicts"]

WITHIN_OF_DATAPARALLEL = 0.95
TARGET_VS_DDP = 1.2


def horovod_contender(model: Any, make_optimizer: Callable[[Any], Any], bucket_mb: float) -> tuple[Any, Any]:
    import hpdl.horovod as hvd

    hvd.init()
    optimizer = hvd.DistributedOptimizer(
        make_optimizer(model), named_parameters=model.named_parameters(), bucket_mb=bucket_mb
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, optimizer


def verdicts(model: str, by_contender: dict[str, dict[str, Any]]) -> list[str]:
    hvd = by_contender["hpdl.horovod"]
    dp = by_contender["hpdl-mpi"]
    of_dp = hvd["samples_per_s"]["median"] / dp["samples_per_s"]["median"]
    return [
        f"{report.verdict(of_dp >= WITHIN_OF_DATAPARALLEL)} {model}: hpdl.horovod at {of_dp:.2f}x hpdl-mpi "
        f"DataParallel's samples/s (target >= {WITHIN_OF_DATAPARALLEL})",
        faster(f"{model}: hpdl.horovod", hvd["vs_ddp"], "DDP", TARGET_VS_DDP),
    ]
