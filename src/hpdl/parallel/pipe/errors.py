"""Errors of the pipeline: a bad configuration or input, and a failure that came from another stage."""

from __future__ import annotations

from hpdl.errors import HpdlError

__all__ = ["PipelineError", "StageFailedError", "BalanceError"]


class PipelineError(HpdlError):
    """The pipeline cannot run as asked (stage outputs that do not fit the next stage, bad inputs)."""


class BalanceError(PipelineError, ValueError):
    """A `balance` that does not fit the model or the number of stages."""


class StageFailedError(PipelineError):
    """Another stage failed; the message carries its exception and original traceback.

    Attributes: `stage` (the stage that failed first) and `remote_traceback`.
    """

    def __init__(self, message: str, *, stage: int = -1, remote_traceback: str = "", detail: str = ""):
        super().__init__(message)
        self.stage = stage
        self.remote_traceback = remote_traceback
        self.detail = detail or message
