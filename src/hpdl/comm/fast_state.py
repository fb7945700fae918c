"""What a communicator's compiled fast paths and its Python share: one `State` object, by contract.

The compiled `Fast` (hpdl/comm/_mpi_fast.c) runs whole blocking collectives
without a Python frame, but the communicator's Python numbers calls too
(the general path), switches the fast paths off (debug, tracing, close),
moves the size gates (shared memory, `hpdl tune`) and starts the pair. Both
sides therefore read and write one object per communicator,
`MpiCommunicator._state`, through the fields below and nothing else: the
compiled module's `State` type (a C struct, read there without a lookup) when
the compiled calls run, else the Python `State` here. A field renamed on one
side only is an AttributeError when the communicator starts, not a silent
fall back to the slow path; tests/test_compiled.py checks that the two types
list the same fields and that the compiled paths keep taking calls.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FIELDS", "State", "new_state"]

FIELDS = (
    "seq",  # the communicator's collectives so far: every path adds one per collective (base._begin, Fast's begin)
    "every",  # the agreement check's period (0: off); set with the ring by Communicator.check_every
    "ring",  # the agreement ring: a list of `every` ints, agreement.entry() of each call (agreement.Ledger.ring)
    "pair",  # the two-rank messages' Pair (pairs.py, or the compiled one), or None
    "plain",  # fast calls allowed: neither debug nor tracing nor closed (Communicator._refresh)
    # per operation, the bytes from which a call leaves the fast path (mpi_node.NodeEngine._open_shm_gates)
    "fast_allreduce_below",
    "fast_allgather_below",
    "fast_reduce_scatter_below",
    "fast_broadcast_below",
    # per operation, the bytes each way below which it travels as the pair's messages (0: never)
    "pair_allreduce_below",
    "pair_allgather_below",
    "pair_reduce_scatter_below",
    "pair_broadcast_below",
)
"""The fields, in the order of the C struct's members (`State` in _mpi_fast.c)."""


class State:
    """The fields without the compiled module (HPDL_COMPILED=0, or no build): the C type's defaults."""

    __slots__ = FIELDS

    def __init__(self) -> None:
        self.seq = 0
        self.every = 0
        self.ring: Any = None
        self.pair: Any = None
        self.plain = False
        self.fast_allreduce_below = 0.0
        self.fast_allgather_below = 0.0
        self.fast_reduce_scatter_below = 0.0
        self.fast_broadcast_below = 0.0
        self.pair_allreduce_below = 0.0
        self.pair_allgather_below = 0.0
        self.pair_reduce_scatter_below = 0.0
        self.pair_broadcast_below = 0.0


def new_state(module: Any) -> Any:
    """A fresh state: the compiled module's `State` where `module` is it (its `Fast` reads only that), else ours."""
    return State() if module is None else module.State()
