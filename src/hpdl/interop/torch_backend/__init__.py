"""The "hpdl" torch.distributed backend: a `ProcessGroup` whose every call runs on an hpdl `Communicator`.

    import torch.distributed as dist
    import hpdl                          # registers "hpdl"
    dist.init_process_group("hpdl")      # under hpdl launch, mpiexec or srun

See docs/torch_backend.md.
"""

from hpdl.interop.torch_backend.process_group import HpdlProcessGroup

__all__ = ["HpdlProcessGroup"]
