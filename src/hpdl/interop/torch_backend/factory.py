"""`create_process_group`: what torch calls for `init_process_group("hpdl")` and `new_group(backend="hpdl")`.

The default group is a duplicate of hpdl's MPI world (its own MPI
communicator, so that torch's calls never mix with the program's own hpdl
calls); a sub-group is an MPI communicator made by its members alone
(`MPI_Comm_create_group` from `global_ranks_in_group`), since torch calls
this function only on the ranks inside the group.
"""

from __future__ import annotations

import sys
import time
import zlib
from typing import Any

from hpdl.runtime.environment import detect, torch_release

__all__ = ["create_process_group", "LaunchError"]

HOW_TO_LAUNCH = (
    "start it under an MPI launcher: `hpdl launch -n N python script.py`, `mpiexec -n N python script.py` or "
    "`srun -n N python script.py` (no MASTER_ADDR/MASTER_PORT needed)"
)


class LaunchError(RuntimeError):
    """The job was not started in a way the hpdl backend can use."""


_meeting: Any = None
"""A duplicate of MPI_COMM_WORLD (made with the default group) on which a new sub-group's members meet."""

MIN_TORCH = (2, 11)
"""The oldest torch the backend was tested on (2.11.0, 2.13.0 and 2.14.1; the pybind method names of Python process
groups changed often before). On 2.11 and 2.12 a PREMUL_SUM's factor is not readable from Python: an error."""


def unavailable() -> str:
    """Why this torch cannot run the backend ("" when it can)."""
    import torch

    if torch_release() >= MIN_TORCH:
        return ""
    needed = ".".join(map(str, MIN_TORCH))
    return f"the hpdl torch.distributed backend needs torch >= {needed} (this is {torch.__version__})"


def requested_device_backends() -> dict[str, str]:
    """The device -> backend map of the `init_process_group` / `new_group` call being served ({} when not found).

    torch hands a backend's creator no device map, so it is read from torch's own frame
    (`_new_process_group_helper`'s `backend_config`, torch 2.11-2.14).
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_new_process_group_helper":
            getter = getattr(frame.f_locals.get("backend_config"), "get_device_backend_map", None)
            return {str(d): str(b) for d, b in getter().items()} if callable(getter) else {}
        frame = frame.f_back  # type: ignore[assignment]
    return {}


def beside_another_backend(devices: dict[str, str], call: str = "init_process_group") -> bool:
    """Whether "hpdl" was asked for beside another backend ("cpu:hpdl,cuda:nccl"). From torch 2.14 hpdl then
    serves its devices as a `Backend` in torch's own group; before, a Python process group replaces torch's whole
    group, so the other backend would be dropped without a word: an error that says what to do instead."""
    import torch

    from hpdl.interop.torch_backend.process_group import python_backends

    others = [f"{device}:{backend}" for device, backend in devices.items() if backend.lower() != "hpdl"]
    if not others or python_backends():
        return bool(others)
    spec = ",".join(f"{device}:{backend}" for device, backend in devices.items())
    raise LaunchError(
        f"{call}({spec!r}): before torch 2.14 hpdl's process group replaces torch's whole group (torch "
        f"{torch.__version__} lets a Python backend sit beside no other), so {', '.join(others)} would be "
        "ignored and those tensors would go through hpdl without a word. Use 'hpdl' alone (CUDA tensors then go "
        "through MPI: CUDA-aware or staged through the host), keep the other backend as the default group "
        "and make an hpdl group for CPU tensors with dist.new_group(backend='hpdl'), or use torch >= 2.14."
    )


def create_process_group(backend_options: Any, pg_options: Any) -> Any:
    if why := unavailable():
        raise LaunchError(f"{why}; upgrade torch, or use hpdl's own API (hpdl.init(), DataParallel) on this one")
    launch = detect()
    if launch.launcher == "torchrun" or launch.backend == "torch":
        raise LaunchError(
            f"init_process_group('hpdl'): this process was started by {launch.launcher} (torch-style "
            "variables, no MPI); the hpdl backend runs on MPI, and torchrun's N processes would each be a "
            f"1-rank MPI world. Use backend 'gloo' or 'nccl' under torchrun, or {HOW_TO_LAUNCH}."
        )
    import hpdl
    from hpdl.comm.mpi_backend import MPI, MpiCommunicator
    from hpdl.interop.torch_backend.process_group import HpdlProcessGroup, _guard_from_compile, backend_class
    from hpdl.interop.torch_backend.progress import progress, timings

    timings()  # a bad HPDL_TORCH_*_US is an error here, naming it
    world = hpdl.init("mpi")
    ranks = [int(r) for r in backend_options.global_ranks_in_group]
    try:
        beside = beside_another_backend(requested_device_backends(), "new_group" if ranks else "init_process_group")
    except LaunchError:
        # The default group's ranks all refuse, but not at the same moment: one that raised first and tried again
        # (as the message says) dropped the store of this attempt's rendezvous while a later rank was still
        # connecting to it, and both waited for torch's store timeout. So every rank has left the rendezvous
        # first. (A sub-group's creation starts no rendezvous, and only its members get here.)
        if not ranks:
            progress.call(world.barrier)
        raise
    size, rank = int(backend_options.group_size), int(backend_options.group_rank)
    seconds = backend_options.timeout.total_seconds() if backend_options.timeout is not None else world.timeout
    timeout = min(world.timeout, seconds) if seconds > 0 else world.timeout
    _guard_from_compile()
    group_class = backend_class() if beside else HpdlProcessGroup  # (a Backend: torch's group holds it)
    if not ranks:  # the default group
        if size != world.size or rank != world.rank:
            raise LaunchError(
                f"init_process_group('hpdl'): torch says rank {rank} of {size}, MPI says rank {world.rank} of "
                f"{world.size}. Let MPI decide: leave rank/world_size out and {HOW_TO_LAUNCH}."
            )
        global _meeting
        comm = progress.call(lambda: world.split(0, world.rank))
        comm.timeout = timeout
        if _meeting is None:
            _meeting = progress.call(MPI.COMM_WORLD.Dup)  # every rank is here: a collective is safe
        return group_class(comm, list(range(size)))
    if len(ranks) != size or ranks[rank] != world.rank:
        raise LaunchError(
            f"new_group(backend='hpdl'): torch's global ranks {ranks} do not match MPI's (this is MPI rank "
            f"{world.rank}); the default process group must number ranks as MPI does"
        )

    def create() -> Any:
        if _meeting is not None:
            meet(_meeting, ranks, timeout)
        members = MPI.COMM_WORLD.Get_group().Incl(ranks)
        sub = MPI.COMM_WORLD.Create_group(members, tag=group_tag(ranks))
        members.Free()
        return MpiCommunicator(sub, timeout=timeout, debug=world.debug, tuning=getattr(world, "_tuning", None))

    return group_class(progress.call(create), ranks)


def group_tag(ranks: list[int]) -> int:
    """The MPI tag of a sub-group's creation (and of its members' meeting): the same on every member."""
    return zlib.crc32(repr(ranks).encode()) % 32768


def meet(meeting: Any, ranks: list[int], timeout: float) -> None:
    """Every member of a new sub-group arrives, within `timeout`, before `MPI_Comm_create_group`.

    That call waits for every member without a bound: a member that never calls `new_group` would hang
    the others. Here the first member hears from every other and answers each; a member that does not
    come is a `CommTimeoutError` naming it (on the others: naming the first member, who never answered).
    Receives that time out are cancelled, so a later meeting of the same ranks is not confused by them.
    """
    from mpi4py import MPI

    from hpdl.comm.work import poll_until
    from hpdl.errors import CommTimeoutError

    me, leader = meeting.Get_rank(), ranks[0]
    tag = group_tag(ranks)
    token = bytearray(1)

    def wait(requests: dict[int, Any], what: str) -> None:
        # Test() of a finished request stays true (it became MPI_REQUEST_NULL)
        if poll_until(lambda: all(request.Test() for request in requests.values()), time.perf_counter() + timeout):
            return
        missing = [r for r, request in requests.items() if not request.Test()]
        for r in missing:
            requests[r].Cancel()
        raise CommTimeoutError(
            f"new_group(backend='hpdl') of ranks {ranks}: {what.format(missing)} within {timeout:g} s. "
            "Every rank must call new_group (and DeviceMesh) with the same ranks in the same order.",
            op="new_group",
            missing=tuple(missing),
        )

    if me == leader:
        arrivals = {r: meeting.Irecv([bytearray(1), MPI.BYTE], source=r, tag=tag) for r in ranks[1:]}
        wait(arrivals, "no word from rank(s) {}")
        wait({r: meeting.Isend([token, MPI.BYTE], dest=r, tag=tag) for r in ranks[1:]}, "could not answer rank(s) {}")
    else:
        answer = meeting.Irecv([bytearray(1), MPI.BYTE], source=leader, tag=tag)
        wait({leader: meeting.Isend([token, MPI.BYTE], dest=leader, tag=tag)}, "could not reach rank(s) {}")
        wait({leader: answer}, "no answer from rank(s) {} (the group's first rank, which waits for every member)")
