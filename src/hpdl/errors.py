"""Errors that hpdl raises instead of hanging or failing late.

Every error says what happened, on which rank, and what to do about it.
"""

from __future__ import annotations

__all__ = [
    "HpdlError",
    "CommError",
    "CommTimeoutError",
    "CollectiveMismatchError",
    "NotInitializedError",
    "BackendUnavailableError",
    "TuneFileError",
]


class HpdlError(RuntimeError):
    """Base class of every error hpdl raises on its own account."""


class CommError(HpdlError):
    """A collective or point-to-point operation failed in the engine (peer gone, engine error)."""


class CommTimeoutError(CommError, TimeoutError):
    """A wait ran past its timeout; the message names the operation and the missing ranks."""

    def __init__(self, message: str, *, op: str = "", seq: int = -1, missing: tuple[int, ...] = ()):
        super().__init__(message)
        self.op = op
        self.seq = seq
        self.missing = missing


class CollectiveMismatchError(CommError):
    """Ranks called different collectives at the same point (debug mode found it before it could hang)."""


class NotInitializedError(HpdlError):
    """A communicator was used before `hpdl.init()` or after `hpdl.finalize()`."""


class BackendUnavailableError(HpdlError):
    """The requested backend cannot start here; the message says how to get it."""


class TuneFileError(HpdlError):
    """The shared-memory tuning file (`hpdl tune`) exists but cannot be used as written."""
