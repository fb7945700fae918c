"""`create_process_group`: what torch calls for `init_process_group("hpdl")` and `new_group(backend="hpdl")`.

The default group is a duplicate of hpdl's MPI world (its own MPI
communicator, so that torch's calls never mix with the program's own hpdl
calls); a sub-group is an MPI communicator made by its members alone
(`MPI_Comm_create_group` from `global_ranks_in_group`), since torch calls
this function only on the ranks inside the group.
"""

from __future__ import annotations

import zlib
from typing import Any

from hpdl.runtime.environment import detect

__all__ = ["create_process_group", "LaunchError"]

HOW_TO_LAUNCH = (
    "start it under an MPI launcher: `hpdl launch -n N python script.py`, `mpiexec -n N python script.py` or "
    "`srun -n N python script.py` (no MASTER_ADDR/MASTER_PORT needed)"
)


class LaunchError(RuntimeError):
    """The job was not started in a way the hpdl backend can use."""


MIN_TORCH = (2, 13)
"""The oldest torch the backend was tested on (the pybind method names of Python process groups changed often)."""


def create_process_group(backend_options: Any, pg_options: Any) -> Any:
    import torch

    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if version < MIN_TORCH:
        raise LaunchError(
            f"the hpdl torch.distributed backend needs torch >= {'.'.join(map(str, MIN_TORCH))} (this is "
            f"{torch.__version__}); upgrade torch, or use hpdl's own API (hpdl.init(), DataParallel) on this one"
        )
    launch = detect()
    if launch.launcher == "torchrun" or launch.backend == "torch":
        raise LaunchError(
            f"init_process_group('hpdl'): this process was started by {launch.launcher} (torch-style "
            "variables, no MPI); the hpdl backend runs on MPI, and torchrun's N processes would each be a "
            f"1-rank MPI world. Use backend 'gloo' or 'nccl' under torchrun, or {HOW_TO_LAUNCH}."
        )
    import hpdl
    from hpdl.comm.mpi_backend import MPI, MpiCommunicator
    from hpdl.interop.torch_backend.process_group import HpdlProcessGroup, _guard_from_compile
    from hpdl.interop.torch_backend.progress import progress

    world = hpdl.init("mpi")
    ranks = [int(r) for r in backend_options.global_ranks_in_group]
    size, rank = int(backend_options.group_size), int(backend_options.group_rank)
    seconds = backend_options.timeout.total_seconds() if backend_options.timeout is not None else world.timeout
    timeout = min(world.timeout, seconds) if seconds > 0 else world.timeout
    _guard_from_compile()
    if not ranks:  # the default group
        if size != world.size or rank != world.rank:
            raise LaunchError(
                f"init_process_group('hpdl'): torch says rank {rank} of {size}, MPI says rank {world.rank} of "
                f"{world.size}. Let MPI decide: leave rank/world_size out and {HOW_TO_LAUNCH}."
            )
        comm = progress.call(lambda: world.split(0, world.rank))
        comm.timeout = timeout
        return HpdlProcessGroup(comm, list(range(size)))
    if len(ranks) != size or ranks[rank] != world.rank:
        raise LaunchError(
            f"new_group(backend='hpdl'): torch's global ranks {ranks} do not match MPI's (this is MPI rank "
            f"{world.rank}); the default process group must number ranks as MPI does"
        )

    def create() -> Any:
        members = MPI.COMM_WORLD.Get_group().Incl(ranks)
        sub = MPI.COMM_WORLD.Create_group(members, tag=zlib.crc32(repr(ranks).encode()) % 32768)
        members.Free()
        return MpiCommunicator(sub, timeout=timeout, debug=world.debug)

    return HpdlProcessGroup(progress.call(create), ranks)
