"""Sharded checkpoints: each rank writes its shard, any layout loads it (different ranks, stage or strategy).

    hpdl.checkpoint.save("ckpt/", model, optimizer)      # collective; ZeRO, DataParallel or plain models
    hpdl.checkpoint.load("ckpt/", model, optimizer)      # reshards to this run's layout, no offline step
    hpdl.checkpoint.export("ckpt/", "model.pt")          # one consolidated state_dict for inference
    hpdl.checkpoint.read_full_tensor("ckpt/", "fc.weight")

The format (`hpdl.checkpoint.format`) records, per logical tensor, its
global shape and dtype and which part each chunk holds (a flat range or an
N-d box), so other layouts (tensor and pipeline parallel) write and read it
too (`ShardReader`). The format knows no strategy: a layout that splits
parameters over ranks (ZeRO) implements `ShardedState` (and its optimizer
`ShardedOptimizer`) and writes and reads its own chunks. The single-file
trainer checkpoint is `hpdl.train.checkpoint`; both raise the errors of
`hpdl.checkpoint.errors`.
"""

from hpdl.checkpoint.errors import CheckpointError, CorruptShardError, MissingShardError
from hpdl.checkpoint.reader import ShardReader, read_full_tensor
from hpdl.checkpoint.sharded import ShardedOptimizer, ShardedState, ShardWriter, commit, export, load, new_writer, save

consolidate = export
"""The same as `export`."""

__all__ = [
    "save",
    "load",
    "export",
    "consolidate",
    "read_full_tensor",
    "ShardReader",
    "ShardWriter",
    "new_writer",
    "commit",
    "CheckpointError",
    "MissingShardError",
    "CorruptShardError",
    "ShardedState",
    "ShardedOptimizer",
]
