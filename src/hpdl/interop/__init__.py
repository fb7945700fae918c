"""Interoperation with other frameworks' distributed APIs.

`hpdl.interop.torch_backend`: the "hpdl" torch.distributed backend, so that
unmodified DDP, FSDP2, DTensor, pipelining and DCP code runs over hpdl's MPI
and shared-memory collectives (`dist.init_process_group("hpdl")`). `import
hpdl` registers it; the process group itself is imported only when a group
is created.
"""

from hpdl.interop.registration import BACKEND_NAME, register

__all__ = ["BACKEND_NAME", "register"]
