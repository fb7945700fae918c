"""The compiled fast paths' set-up: what they look up per call (`FastTables`), and routing a communicator's
blocking allreduce, allgather, reduce_scatter, broadcast, send and recv through the compiled `Fast` (_mpi_fast.c).

`Fast` shares the communicator's changing state through its `State` object
(fast_state.py), not through the communicator's attributes; this module
hands it that object, the tables and the Python methods it passes every call
it does not take to.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Optional

import torch

from hpdl.comm import agreement, mpi_calls
from hpdl.comm.mpi_fast_paths import FastPaths
from hpdl.comm.mpi_library import MOVE_TYPES, NATIVE, OPS
from hpdl.comm.progress import OP_CODES

__all__ = ["COMPILED_PATHS", "FastTables", "compile_blocking_paths"]

COMPILED_PATHS = ("allreduce", "allgather", "reduce_scatter", "broadcast")
PEER_PATHS = ("send", "recv")
DEFINED = {name: vars(FastPaths)[name] for name in COMPILED_PATHS + PEER_PATHS}
"""The Python fast paths as defined, to tell them from a later wrapper (see `compile_blocking_paths`)."""
_NOT_FAST = (None, None, 0)


class FastTables:
    """What the fast paths look up per call: MPI datatype, MPI op (in the form `calls` takes) and agreement code
    per (dtype, op)."""

    def __init__(self, calls: mpi_calls.Calls) -> None:
        handle = self._handle = calls.handle
        self.allreduce: dict[tuple[torch.dtype, str], tuple[Any, Any, int]] = {}
        self.reduce_scatter: dict[tuple[torch.dtype, str], tuple[Any, Any, int]] = {}
        self.move: dict[torch.dtype, tuple[Any, int]] = {}
        self.broadcast: dict[tuple[torch.dtype, Any], tuple[Any, int]] = {}
        for dtype, mpi_type in NATIVE.items():
            name = agreement.dtype_name(dtype)
            for op, mpi_op in OPS.items():
                if (op == "avg" and not (dtype.is_floating_point or dtype.is_complex)) or (
                    dtype.is_complex and op in ("max", "min")
                ):
                    continue  # the general path raises the error that says why
                detail = f"op={op}"
                handles = (handle(mpi_type), handle(mpi_op))
                self.allreduce[dtype, op] = (*handles, agreement.code("allreduce", name, detail))
                self.reduce_scatter[dtype, op] = (*handles, agreement.code("reduce_scatter", name, detail))
        for dtype, mpi_type in MOVE_TYPES.items():
            self.move[dtype] = (handle(mpi_type), agreement.code("allgather", agreement.dtype_name(dtype), ""))

    def add_broadcast(self, dtype: torch.dtype, root: int) -> Optional[tuple[Any, int]]:
        if dtype not in MOVE_TYPES:
            return None
        code = agreement.code("broadcast", agreement.dtype_name(dtype), f"root={root}")
        spec = (self._handle(MOVE_TYPES[dtype]), code)
        self.broadcast[dtype, root] = spec
        return spec


def compile_blocking_paths(comm: FastPaths, calls: mpi_calls.Calls) -> Any:
    """Route `comm`'s allreduce, allgather, reduce_scatter, broadcast, send and recv through the compiled `Fast`:
    the blocking fast paths without a Python frame, the same checks, numbering, progress post and agreement entry;
    every call it does not take goes to the Python method unchanged. Returns the `Fast` (`taken()` counts its calls).

    A method that is no longer the one mpi_fast_paths.py defined (a subclass's, or wrapped on the class by
    instrumentation such as the hybrid benchmark's byte counter) is left alone: it keeps every call."""
    fast = calls.module.Fast(
        comm._state, comm._handle, comm.rank, comm.size, comm._progress.address, torch.Tensor,
        tuple(OP_CODES[name] for name in COMPILED_PATHS),
        tuple(types.MethodType(DEFINED[name], comm) for name in COMPILED_PATHS), comm._fast_slow,
        functools.partial(agreement.check, comm),
    )  # fmt: skip
    ops = [op for op in OPS if op != "avg"]  # avg divides after the call: the Python path; "sum" first
    for op in ops:
        fast.add_op(op, calls.handle(OPS[op]))
    roots = range(min(comm.size, 64))
    tables = comm._fast
    for dtype, mpi_type in MOVE_TYPES.items():
        name = agreement.dtype_name(dtype)
        fast.add_dtype(
            dtype, calls.handle(mpi_type), torch.empty((), dtype=dtype).element_size(), tables.move[dtype][1],
            [tables.allreduce.get((dtype, op), _NOT_FAST)[2] for op in ops],
            [tables.reduce_scatter.get((dtype, op), _NOT_FAST)[2] for op in ops],
            [agreement.code("broadcast", name, f"root={root}") for root in roots],
        )  # fmt: skip
    # send and recv too; recv not where it must probe first (pairs.probe_first: the Python path's own receive)
    peer = [types.MethodType(DEFINED[name], comm) for name in PEER_PATHS]
    fast.add_peer_paths(peer[0], None if comm._probe_first else peer[1], comm._peer_finish)
    for name in COMPILED_PATHS + PEER_PATHS[: 1 if comm._probe_first else 2]:
        if getattr(type(comm), name) is DEFINED[name]:
            setattr(comm, name, getattr(fast, name))
    return fast
