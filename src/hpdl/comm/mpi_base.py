"""What the parts of the MPI communicator share: its state (fast_state.State, shared with the compiled paths),
the attributes its set-up gives every part, and the helpers every part calls.

`MpiCommunicator` (mpi_backend.py) is this class with its parts mixed in:
the fast paths (mpi_fast_paths.py), the general paths (mpi_general.py), the
node's shared-memory engine (mpi_node.py) and the agreement check and
progress board (mpi_board.py). Each part is a subclass of `MpiBase`, so that
what it reads of the others is declared here once.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from hpdl.comm import mpi_calls, shm
from hpdl.comm import tuning as tuning_file
from hpdl.comm.base import Communicator
from hpdl.comm.mpi_library import MPI, library_version
from hpdl.comm.progress import ProgressBoard
from hpdl.comm.work import Work
from hpdl.errors import CommError

__all__ = ["INT_COUNT", "MpiBase", "NO_WAIT", "WAIT"]

WAIT = 2e-3
"""Seconds a blocking fast-path call tests its operation (at full speed, then yielding the core) before it falls
back to the bounded wait of a `Work` (the compiled module's WAIT_SECONDS)."""
NO_WAIT = -1.0
"""The calls' `wait` that hands the operation back untested (the caller's `Work` waits)."""
INT_COUNT = 2**31
"""Bytes from which a message goes to the general path: the compiled calls pass an int count (mpi4py switches
to MPI-4's large-count calls)."""


def _field(name: str, doc: str) -> Any:
    """The communicator's attribute `_<name>` as the state's field `name` (the names the base class and the
    tools that switch the check use: `_seq`, `_every`, ...)."""

    def get(self: MpiBase) -> Any:
        return getattr(self._state, name)

    def put(self: MpiBase, value: Any) -> None:
        setattr(self._state, name, value)

    return property(get, put, doc=doc)


class MpiBase(Communicator):
    """The shared part of `MpiCommunicator`; never made on its own."""

    backend = "mpi"

    _state: Any
    """fast_state.State (the compiled module's where it runs): what the compiled paths and Python share."""
    # The state's fields as the communicator's attributes (see fast_state.FIELDS for what each holds).
    _seq = _field("seq", "The last collective's sequence number.")
    _every = _field("every", "The agreement check's period (0: off).")
    _ring = _field("ring", "The agreement ring (agreement.Ledger.ring).")
    _pair = _field("pair", "The two-rank messages' Pair, or None.")
    _plain = _field("plain", "Fast calls allowed: neither debug nor tracing nor closed.")
    _fast_allreduce_below = _field("fast_allreduce_below", "Bytes from which an allreduce leaves the fast path.")
    _fast_allgather_below = _field("fast_allgather_below", "Bytes (the whole output) from which an allgather does.")
    _fast_reduce_scatter_below = _field("fast_reduce_scatter_below", "Input bytes from which a reduce_scatter does.")
    _fast_broadcast_below = _field("fast_broadcast_below", "Bytes from which a broadcast does.")
    _pair_allreduce_below = _field("pair_allreduce_below", "Bytes below which an allreduce goes as messages.")
    _pair_allgather_below = _field("pair_allgather_below", "Bytes per rank below which an allgather does.")
    _pair_reduce_scatter_below = _field("pair_reduce_scatter_below", "Bytes per rank below which one does.")
    _pair_broadcast_below = _field("pair_broadcast_below", "Bytes below which a broadcast does.")

    # Set by MpiCommunicator.__init__ (mpi_backend.py); read by the parts.
    mpi_comm: Any
    cuda_aware: bool
    shared_memory: bool
    shm_status: str
    shm_thresholds_source: str
    calls: str
    _progress: Any  # mpi_board.WindowBoard
    _exit_comm: Any
    _check_comm: Any
    _tuning: Optional[tuning_file.Tuning]
    _pair_limits: dict[str, int]
    _shm_thresholds: dict[str, tuple[int, int]]
    _shm_smallest: float
    _fused_shm_min: int
    _counted_reduce_scatter: tuple[int, int]
    _node: Optional[shm.NodeCollectives]
    _cross: Any
    _hand_back: Optional[tuple[int, list[Work]]]
    _calls: mpi_calls.Calls
    _handle: Any
    _check_handle: Any
    _handle_of: Callable[[Any], Any]
    _probe_first: bool
    _slots: Any
    _status: Any
    _fast: Any  # mpi_compiled.FastTables
    _fast_allreduce: dict[tuple[torch.dtype, str], tuple[Any, Any, int]]
    _fast_reduce_scatter: dict[tuple[torch.dtype, str], tuple[Any, Any, int]]
    _fast_move: dict[torch.dtype, tuple[Any, int]]
    _fast_broadcast: dict[tuple[torch.dtype, Any], tuple[Any, int]]
    _call_allreduce: Callable[..., Any]
    _call_allgather: Callable[..., Any]
    _call_reduce_scatter: Callable[..., Any]
    _call_broadcast: Callable[..., Any]
    _call_send: Callable[..., Any]
    _call_recv: Callable[..., Any]

    def _shared_memory(self, op: str, nbytes: int, t: torch.Tensor, called: str = "") -> Optional[shm.NodeCollectives]:
        raise NotImplementedError  # mpi_node.NodeEngine

    def _open_shm_gates(self, closed: bool = False) -> None:
        raise NotImplementedError  # mpi_node.NodeEngine

    def _across_nodes(self, t: torch.Tensor, op: str) -> None:
        raise NotImplementedError  # mpi_node.NodeEngine

    @property
    def engine(self) -> str:
        return library_version()

    def _board(self) -> ProgressBoard:
        return self._progress  # type: ignore[no-any-return]

    # Device handling: CUDA tensors go straight to a CUDA-aware MPI, else through a host copy.
    def _host(self, t: torch.Tensor, messages: bool = False) -> torch.Tensor:
        """`messages`: for a pair's exchange (pairs.py), always host memory: MPI_Reduce_local reduces on the CPU."""
        if t.device.type == "cpu":
            return t
        if self.cuda_aware and t.device.type == "cuda" and not messages:
            torch.cuda.current_stream(t.device).synchronize()
            return t
        return t.cpu()

    def _work(self, op: str, seq: int, request: Any, finish: Callable[[], Any], *keep: Any) -> Work:
        """A handle on an MPI request; `keep` holds the buffers MPI uses (it has only their addresses)."""
        return Work(self, op, seq, request.Test, finish, keep=keep)

    def _engine_error(self, op: str, seq: int, exc: Exception) -> Exception:
        """MPI's own error while an operation completes, said in terms of what the caller can fix."""
        if not isinstance(exc, MPI.Exception):
            return exc
        what = op if seq < 0 else f"{op} #{seq}"
        stack = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return CommError(
            f"{what} failed in MPI on rank {self.rank} of {self.size} ({MPI.Get_error_string(exc.Get_error_class())}"
            f": {stack[-1] if stack else exc}). With matching calls MPI does not fail here: the usual cause is ranks "
            "that passed different sizes, dtypes, roots or ops to this operation (MPI compares none of them; hpdl's "
            "agreement check would have named them at its next check); a rank that died is the other. Run with "
            "HPDL_DEBUG=1 to compare every rank's call before it runs."
        )
