"""The `mpi` backend: collectives on torch tensors through mpi4py, without copies.

Contiguous CPU tensors go to MPI as raw memory (address, count, datatype),
so no pickling and no copy (mpi_library.py). GPU tensors go to MPI directly
when the library is CUDA-aware (`cuda_aware()`), else they are staged
through host memory. Every call is non-blocking underneath, so every wait
can time out. On two ranks collectives travel as one message each way, on
4, 8, ... ranks a small allreduce as recursive doubling (pairs.py).

`MpiCommunicator` is its parts put together; this module sets it up (the
topology, the pair, the path settings every rank must share) and closes it:

- mpi_base.py: what the parts share (the state the compiled paths read too:
  fast_state.py), and the helpers they all call;
- mpi_fast_paths.py: the common call in the fewest steps; mpi_compiled.py
  routes its blocking calls through the compiled module (_mpi_fast.c);
- mpi_general.py: every other call, through a nonblocking call and a `Work`;
- mpi_node.py: the node's shared-memory engine and the size gates it sets;
- mpi_board.py: the progress board and the agreement check's vote.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Iterator, Optional

from hpdl.comm import fast_state, fusion, mpi_calls, pairs, same_settings, shm
from hpdl.comm import tuning as tuning_file
from hpdl.comm.base import Communicator
from hpdl.comm.mpi_board import Agreement, WindowBoard, pair_mismatch
from hpdl.comm.mpi_compiled import FastTables, compile_blocking_paths
from hpdl.comm.mpi_fast_paths import FastPaths
from hpdl.comm.mpi_general import GeneralPaths
from hpdl.comm.mpi_library import MPI, cuda_aware, library_version, node_comm
from hpdl.comm.mpi_node import NodeEngine

__all__ = ["MPI", "MpiCommunicator", "cuda_aware", "library_version", "node_comm"]


class MpiCommunicator(FastPaths, GeneralPaths, NodeEngine, Agreement):
    """A communicator over an mpi4py `Comm` (COMM_WORLD or one made by `split`)."""

    def __init__(
        self,
        mpi_comm: Any,
        *,
        timeout: float,
        debug: bool,
        tuning: Optional[tuning_file.Tuning] = None,
        read_tuning: bool = False,
    ):
        """`tuning`: the shared-memory thresholds measured by `hpdl tune` (a parent's, for a split); with
        `read_tuning` rank 0 reads them from the file and every rank takes its answer (hpdl.init's world)."""
        calls, self.calls = mpi_calls.select()
        """Which MPI calls the fast paths make: compiled (hpdl.comm._mpi_fast) or mpi4py's, and why."""
        self._state = fast_state.new_state(calls.module if calls.compiled else None)
        """What the compiled paths and Python share (before the base class sets its fields: `_seq`, `_plain`...)."""
        node = node_comm(mpi_comm)
        super().__init__(
            rank=mpi_comm.Get_rank(),
            size=mpi_comm.Get_size(),
            local_rank=node.Get_rank(),
            local_size=node.Get_size(),
            timeout=timeout,
            debug=debug,
        )
        local_size = node.Get_size()
        node.Free()
        self.mpi_comm = mpi_comm
        self.cuda_aware = cuda_aware()
        self._progress = WindowBoard(mpi_comm, timeout)  # returns once every rank has started
        try:
            self._tuning = tuning_file.agree(mpi_comm, timeout) if read_tuning else tuning
        except Exception:
            self._progress.close()  # every rank raises the same error: leave MPI as hpdl.init found it
            raise
        self.shared_memory = shm.enabled()
        """Use the shared-memory path inside the node (HPDL_SHM); set before the first large collective."""
        # Read once: this is consulted on every collective.
        try:
            if self._tuning is not None:  # every rank must look up the same entry
                local_size = tuning_file.uniform_node_size(mpi_comm, local_size, timeout)
            measured, self.shm_thresholds_source = tuning_file.thresholds_for(
                self._tuning, local_size, library_version()
            )
            """Where the shared-memory thresholds come from: `hpdl tune`'s file, or built in (and why)."""
            self._pair_limits = pairs.limits(self.size)
            """Per collective, the bytes each way below which it travels as messages (pairs.py)."""
            built_in = self.shm_thresholds_source.startswith("built-in")
            self._shm_thresholds = {
                op: shm.thresholds(op, measured[op], built_in and self._pair_limits[op] >= pairs.ANY_SIZE)
                for op in shm.DEFAULT_THRESHOLDS
            }
            self._fused_shm_min = shm.fused_threshold()
            self._counted_reduce_scatter = mpi_calls.counted_reduce_scatter(library_version())
            """Input bytes [from, to) where reduce_scatter calls MPI_Ireduce_scatter, not ..._block."""
            same_settings.agree(mpi_comm, self._path_settings(), timeout)
        except Exception:
            self._progress.close()  # every rank raises the same error: leave MPI as it was
            raise
        self._exit_comm = mpi_comm.Dup()
        """Where the exit barrier meets: MPI pairs nonblocking collectives by order alone, so on `mpi_comm` a
        rank still inside a collective would take the others' exit barrier for it (and return garbage)."""
        self._check_comm = mpi_comm.Dup()
        """Where the agreement check's vote and exchange of rings meet (`_vote`, `_vote_gather`): on `mpi_comm` (or
        the pair's messages) a rank in the check takes a peer's user collective of the same size for its vote, and
        each returns the other's bytes; a rank that skipped a collective was then reported as an allgather of the
        check's rings (1536 B) that the user never called. Here the check meets only the check: a rank that waits
        in it while a peer waits in a user collective reads on the progress board what each called."""
        self._node = None
        self._cross: Any = None
        self._hand_back = None
        """Set by `start_briefly`: where the fast paths put an operation still running after their short wait."""
        self._pair = None
        self._open_shm_gates()
        self._fast = FastTables(calls)
        self._fast_allreduce = self._fast.allreduce
        self._fast_reduce_scatter = self._fast.reduce_scatter
        self._fast_move = self._fast.move
        self._fast_broadcast = self._fast.broadcast
        self._handle = calls.handle(mpi_comm)
        self._check_handle = calls.handle(self._check_comm)
        self._call_allreduce = calls.allreduce
        self._call_allgather = calls.allgather
        self._call_reduce_scatter = calls.reduce_scatter
        self._call_broadcast = calls.broadcast
        self._call_send = calls.send
        self._call_recv = calls.recv
        self._calls = calls
        self._handle_of = calls.handle
        self._probe_first = pairs.probe_first(library_version())
        """Receive only once a matched probe told the message's length (outside MPICH: see pairs.probe_first)."""
        if any(self._pair_limits.values()):
            self._start_pair(calls)
        self._slots = self._progress.slots
        self._status = MPI.Status()
        self.shm_status = "not started (starts with the first collective above its size threshold)"
        self._compiled: Any = None
        """The compiled `Fast` that takes this communicator's blocking calls (its `taken()` counts them), or None."""
        if calls.compiled:
            self._compiled = compile_blocking_paths(self, calls)

    def _start_pair(self, calls: mpi_calls.Calls) -> None:
        """Two ranks: the small collectives' messages, on a duplicate of the communicator; every fast path's MPI
        call goes through the routing below (the compiled `Fast` reads `_pair` itself)."""
        span = (MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767) + 1  # (a predefined attribute of COMM_WORLD only)
        mismatch = functools.partial(pair_mismatch, weakref.ref(self))  # (the pair must not keep this alive)
        pair_type = calls.module.Pair if calls.compiled else pairs.Pair
        self._pair = pair_type(self.mpi_comm.Dup(), self.rank, self.size, span, mismatch, self._probe_first)
        self._call_allreduce = self._routed_allreduce
        self._call_allgather = self._routed_allgather
        self._call_reduce_scatter = self._routed_reduce_scatter
        self._call_broadcast = self._routed_broadcast
        self._open_shm_gates()

    # The fast paths' MPI calls on a two-rank communicator: messages below the pair's limits, the collective
    # from there (bytes each way: the allreduce's or broadcast's buffer, an allgather's or reduce_scatter's
    # block per rank, as the compiled `Fast` compares).
    def _routed_allreduce(self, comm: Any, address: int, nbytes: int, datatype: Any, op: Any, wait: float) -> Any:
        state = self._state
        if nbytes < state.pair_allreduce_below and comm == self._handle:
            return state.pair.allreduce(address, nbytes, datatype, op, wait)
        return self._calls.allreduce(comm, address, nbytes, datatype, op, wait)

    def _routed_allgather(self, comm: Any, send: int, out: int, nbytes: int, datatype: Any, wait: float) -> Any:
        state = self._state
        if nbytes < state.pair_allgather_below and comm == self._handle:
            return state.pair.allgather(send, out, nbytes, datatype, wait)
        return self._calls.allgather(comm, send, out, nbytes, datatype, wait)

    def _routed_reduce_scatter(
        self, comm: Any, address: int, out: int, nbytes: int, datatype: Any, op: Any, wait: float
    ) -> Any:  # fmt: skip
        state = self._state
        if nbytes < state.pair_reduce_scatter_below and comm == self._handle:
            return state.pair.reduce_scatter(address, out, nbytes, datatype, op, wait)
        return self._calls.reduce_scatter(comm, address, out, nbytes, datatype, op, wait)

    def _routed_broadcast(self, comm: Any, address: int, nbytes: int, datatype: Any, root: int, wait: float) -> Any:
        state = self._state
        if nbytes < state.pair_broadcast_below and comm == self._handle:
            return state.pair.broadcast(address, nbytes, datatype, root, wait)
        return self._calls.broadcast(comm, address, nbytes, datatype, root, wait)

    @property
    def pairs(self) -> str:
        """Which collectives travel as messages (pairs.py), in words."""
        return pairs.describe(self._pair_limits if self._pair is not None else dict.fromkeys(pairs.KINDS, 0))

    def _path_settings(self) -> dict[str, int]:
        """What decides, per call, which path a collective takes and how: every rank must read the same."""
        settings = {
            "HPDL_DEBUG": int(self._debug),
            "HPDL_CHECK_EVERY": self.check_every,
            "HPDL_SHM": int(self.shared_memory),
            "HPDL_SHM_MB (bytes)": shm.segment_bytes(),
            "HPDL_SHM_PIECE_MB (bytes)": shm.piece_bytes(),
            "HPDL_SHM_MIN_ALLREDUCE_COALESCED": self._fused_shm_min,
            "HPDL_FUSION_MB (bytes)": fusion.bucket_bytes(None),
            "HPDL_COUNTED_REDUCE_SCATTER (from)": self._counted_reduce_scatter[0],
            "HPDL_COUNTED_REDUCE_SCATTER (to)": self._counted_reduce_scatter[1],
        }
        for op, below in self._pair_limits.items():
            settings[f"HPDL_PAIR_BYTES ({op})"] = below
        for op, (zero_copy, ordinary) in self._shm_thresholds.items():
            settings[f"HPDL_SHM_MIN_{op.upper()} (shared buffers)"] = zero_copy
            settings[f"HPDL_SHM_MIN_{op.upper()} (ordinary tensors)"] = ordinary
        return settings

    def _split(self, color: Optional[int], key: int, seq: int) -> Optional[Communicator]:
        # Agree on the split with a bounded collective first, so that a missing rank
        # is a timeout error rather than a hang inside MPI_Comm_split.
        self._barrier(seq).wait()
        child = self.mpi_comm.Split(MPI.UNDEFINED if color is None else color, key)
        if child == MPI.COMM_NULL:
            return None
        made = MpiCommunicator(child, timeout=self.timeout, debug=self.debug, tuning=self._tuning)
        made.check_every = self.check_every
        return made

    @contextlib.contextmanager
    def _on_exit_channel(self) -> Iterator[None]:
        """Run the exit barrier's collectives on `_exit_comm`, over plain MPI (not the shared-memory engine)."""
        main = self.mpi_comm
        self.mpi_comm = self._exit_comm
        self._open_shm_gates(closed=True)
        try:
            yield
        finally:
            self.mpi_comm = main
            self._open_shm_gates()

    def _close(self) -> None:
        # Freeing the window waits for every rank: meet at a bounded barrier first,
        # and leave the resources to the process exit if someone does not come.
        with self._on_exit_channel():
            self._exit_barrier()
        if self._broken:
            return  # collectives may be pending; freeing would wait on them
        self._exit_comm.Free()
        self._check_comm.Free()
        self._pair = None  # its communicator goes with it, and with the last of its collectives in flight
        if self._node is not None:
            self._node.close()
            self._node.node.Free()
        if self._cross is not None:
            self._cross.Free()
        self._progress.close()
        if self.mpi_comm != MPI.COMM_WORLD:
            self.mpi_comm.Free()
