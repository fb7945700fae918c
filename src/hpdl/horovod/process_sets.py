"""Horovod's process sets: subsets of the ranks that run collectives together.

Each process set owns a sub-communicator of its members (split off the
world once, when the set is added), so its collectives are matched only
among its members, and a private one for `DistributedOptimizer`'s gradient
buckets, so the optimizer's traffic never interleaves with the named
operations of the Horovod API. As in Horovod, `add_process_set` and
`remove_process_set` are called by every rank, in the same order; the
engine agrees on each change as on a named operation, so ranks that pass
different ranks, or that are at different operations, get an error.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

from hpdl.comm.base import Communicator
from hpdl.horovod import basics

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]


class ProcessSet:
    """A set of ranks (a list of world ranks, or an mpi4py communicator) for `process_set=` arguments."""

    process_set_id: Optional[int] = None
    ranks: Optional[list[int]] = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Union[Sequence[int], Any]):
        self.comm: Optional[Communicator] = None
        self._optimizer_comm: Optional[Communicator] = None
        if isinstance(ranks_or_comm, (list, tuple, range, set)):
            ranks = sorted(ranks_or_comm)
            if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
                raise ValueError("ProcessSet takes a list of process ranks (ints) or an mpi4py Comm object")
            self.ranks = ranks
        else:
            if not _is_mpi_comm(ranks_or_comm):
                raise ValueError("ProcessSet takes a list of process ranks (ints) or an mpi4py Comm object")
            self.mpi_comm = ranks_or_comm

    def size(self) -> Optional[int]:
        """Number of ranks in the set (None before the set is added)."""
        if self.process_set_id is None:
            return None
        return len(self._ranks())

    def rank(self) -> Optional[int]:
        """This rank's position in the set (None before the set is added or when this rank is outside it).

        Operations such as broadcast still take *world* ranks (`root_rank`), as in Horovod.
        """
        if self.process_set_id is None:
            return None
        me = basics.rank()
        ranks = self._ranks()
        return ranks.index(me) if me in ranks else None

    def included(self) -> Optional[bool]:
        """Whether this rank belongs to the set (None before its ranks are known)."""
        if self.process_set_id == 0:
            return True
        if self.ranks is None:
            return None
        return basics.rank() in self.ranks

    def _ranks(self) -> list[int]:
        if self.process_set_id == 0:
            return list(range(basics.size()))
        assert self.ranks is not None
        return self.ranks

    def _invalidate(self) -> None:
        self.process_set_id = None
        self.comm = None
        self._optimizer_comm = None

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


def _is_mpi_comm(obj: Any) -> bool:
    try:
        from mpi4py import MPI
    except ImportError:
        return False
    return isinstance(obj, MPI.Comm)


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


class _Registry:
    """The process sets of the current world, by id (0 is the global set)."""

    def __init__(self) -> None:
        self.world: Optional[Communicator] = None
        self.sets: dict[int, ProcessSet] = {}
        self.next_id = 1

    def reset(self, world: Communicator) -> None:
        for ps in list(self.sets.values()):
            if ps is not global_process_set:
                ps._invalidate()
        self.world = world
        global_process_set.ranks = list(range(world.size))
        global_process_set.comm = world.split(0, world.rank)
        global_process_set._optimizer_comm = world
        self.sets = {0: global_process_set}
        self.next_id = 1


registry = _Registry()
_removal_hooks: list[Callable[[ProcessSet], None]] = []


_agreement: list[Callable[[str, list[int], Callable[[Communicator], None]], None]] = []


def agree_by(negotiate: Callable[[str, list[int], Callable[[Communicator], None]], None]) -> None:
    """How a set change is agreed with the other ranks: the engine, which imports this module, hands it over."""
    _agreement[:] = [negotiate]


def on_removal(hook: Callable[[ProcessSet], None]) -> None:
    """Call `hook(process_set)` when a set is removed: the engine, which imports this module, drops its state."""
    _removal_hooks.append(hook)


def current_world() -> Communicator:
    """The world communicator, with the Horovod state set up for it (after `hvd.init()`)."""
    comm = basics.world()
    if registry.world is not comm:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return comm


def resolve(process_set: Optional[ProcessSet], op: str) -> ProcessSet:
    """The process set an operation runs on; a clear error for a removed set or a rank outside it."""
    current_world()
    ps = global_process_set if process_set is None else process_set
    if not isinstance(ps, ProcessSet):
        raise ValueError(f"{op}: process_set={process_set!r} is not a hvd.ProcessSet")
    if ps.process_set_id is None or registry.sets.get(ps.process_set_id) is not ps:
        raise ValueError(f"{op}: {ps} was never added or has been removed; use hvd.add_process_set first")
    if ps.comm is None:
        raise ValueError(f"{op}: rank {basics.rank()} is not in {ps}; only its members may run collectives on it")
    return ps


def optimizer_comm(ps: ProcessSet) -> Communicator:
    """The set's communicator for gradient buckets (split off once, on the members' first optimizer)."""
    if ps._optimizer_comm is None:
        assert ps.comm is not None
        ps._optimizer_comm = ps.comm.split(0, ps.comm.rank)
    assert ps._optimizer_comm is not None
    return ps._optimizer_comm


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Add a process set (every rank calls this, in the same order) and return it, ready to use."""
    world = current_world()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None and ps.mpi_comm is not None:
        group = ps.mpi_comm.Get_group()
        from mpi4py import MPI

        world_group = MPI.COMM_WORLD.Get_group()
        ps.ranks = sorted(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world_group))
    assert ps.ranks is not None
    bad = [r for r in ps.ranks if not 0 <= r < world.size]
    if bad or not ps.ranks:
        raise ValueError(f"add_process_set: ranks {ps.ranks} must be a non-empty list of ranks in [0, {world.size})")
    if len(set(ps.ranks)) != len(ps.ranks):
        raise ValueError(f"add_process_set: ranks {ps.ranks} has duplicates")
    for other in registry.sets.values():
        if other._ranks() == ps.ranks:
            raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    ranks = ps.ranks

    def split(parent: Communicator) -> None:
        ps.comm = parent.split(0 if world.rank in ranks else None, world.rank)
        ps._optimizer_comm = None
        ps.process_set_id = registry.next_id
        registry.next_id += 1
        registry.sets[ps.process_set_id] = ps

    _agree("add", registry.next_id, ranks, split)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Remove a process set added before (every rank calls this); False for the global or an unknown set."""
    current_world()
    ps_id = process_set.process_set_id
    if ps_id is None or ps_id == 0 or registry.sets.get(ps_id) is not process_set:
        return False

    def remove(parent: Communicator) -> None:
        for hook in _removal_hooks:
            hook(process_set)
        del registry.sets[ps_id]
        process_set._invalidate()

    _agree("remove", ps_id, process_set._ranks(), remove)
    return True


def _agree(action: str, ps_id: int, ranks: list[int], change: Callable[[Communicator], None]) -> None:
    """Make `change` on every rank at one agreed point of the global set's name-matched operations.

    The engine (which imports this module) negotiates it as Horovod's coordinator handles a process-set
    change: ranks that pass different ranks get an error on every rank, and ranks that are at different
    operations (one adding a set while another waits in an allreduce) get "cannot be matched" instead of
    pairing unrelated collectives.
    """
    if not _agreement:
        raise RuntimeError("hpdl.horovod.engine is not loaded: import hpdl.horovod, not its modules one by one")
    _agreement[0](f"{action}_process_set.{ps_id}", ranks, change)
