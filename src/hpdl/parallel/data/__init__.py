"""Data parallelism: every rank holds the whole model and averages gradients, bucketed and overlapped with backward.

`data_parallel` holds `DataParallel` and `broadcast_tensors`; `buckets` the
gradient buckets and their reducer (`buckets.GradientReducer`), which ZeRO
stage 1 and the Horovod-style optimizer reuse.
"""

from hpdl.parallel.data.data_parallel import DataParallel, broadcast_tensors

__all__ = ["DataParallel", "broadcast_tensors"]
