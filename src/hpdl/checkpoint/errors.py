"""Errors of every checkpoint hpdl reads or writes (sharded here, single-file in `hpdl.train.checkpoint`).

They live with the checkpoint package, the lowest layer that raises them;
`hpdl.train` re-exports `CheckpointError` for the code that took it there.
"""

from __future__ import annotations

from hpdl.errors import HpdlError

__all__ = ["CheckpointError", "MissingShardError", "CorruptShardError"]


class CheckpointError(HpdlError):
    """A checkpoint cannot be read or does not fit what it is loaded into; the message names the file."""


class MissingShardError(CheckpointError):
    """A shard file that the metadata lists is not there; the message names it and the rank that wrote it."""


class CorruptShardError(CheckpointError):
    """A shard file's bytes do not match the digest recorded when it was written; the message names it."""
