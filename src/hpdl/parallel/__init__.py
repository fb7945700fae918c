"""Parallel strategies that wrap a plain `torch.nn.Module`: data parallelism (more to come: ZeRO, pipeline, tensor)."""

from hpdl.parallel.data_parallel import DataParallel, broadcast_tensors

__all__ = ["DataParallel", "broadcast_tensors"]
