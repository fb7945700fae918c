"""The `self` backend: a one-rank communicator with no engine, so every script also runs as plain `python`."""

from __future__ import annotations

from typing import Optional

import torch

from hpdl.comm.base import Communicator
from hpdl.comm.progress import LocalBoard, ProgressBoard
from hpdl.comm.work import Work, completed

__all__ = ["SelfCommunicator"]


class SelfCommunicator(Communicator):
    """Size 1: reductions leave data as it is, gathers copy it, point-to-point has no peer."""

    backend = "self"

    def __init__(self, *, timeout: float, debug: bool):
        super().__init__(rank=0, size=1, local_rank=0, local_size=1, timeout=timeout, debug=debug)
        self._progress = LocalBoard()

    def _board(self) -> ProgressBoard:
        return self._progress

    def _allreduce(self, t: torch.Tensor, op: str, seq: int) -> Work:
        return completed(self, "allreduce", seq, t)

    def _allgather(self, t: torch.Tensor, sizes: list[int], seq: int, out: Optional[torch.Tensor] = None) -> Work:
        return completed(self, "allgather", seq, _copy(t, out))

    def _reduce_scatter(self, t: torch.Tensor, op: str, seq: int, out: Optional[torch.Tensor] = None) -> Work:
        return completed(self, "reduce_scatter", seq, _copy(t, out))

    def _broadcast(self, t: torch.Tensor, root: int, seq: int) -> Work:
        return completed(self, "broadcast", seq, t)

    def _alltoall(self, t: torch.Tensor, seq: int, out: Optional[torch.Tensor] = None) -> Work:
        return completed(self, "alltoall", seq, _copy(t, out))

    def _barrier(self, seq: int) -> Work:
        return completed(self, "barrier", seq, None)

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> Work:  # unreachable: check_peer rejects every dst
        raise ValueError("send: a one-rank communicator has no other rank")

    def _recv(self, t: torch.Tensor, src: Optional[int], tag: int) -> Work:
        raise ValueError("recv: a one-rank communicator has no other rank")

    def _split(self, color: Optional[int], key: int, seq: int) -> Optional[Communicator]:
        return None if color is None else SelfCommunicator(timeout=self.timeout, debug=self.debug)

    def _close(self) -> None:
        pass


def _copy(t: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    return t.clone() if out is None else out.copy_(t)
