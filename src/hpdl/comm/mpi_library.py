"""The MPI library under the mpi backend, and how torch tensors map onto it: datatypes, ops, buffers.

Contiguous CPU tensors go to MPI as raw memory (address, count, datatype),
so no pickling and no copy. float16 and bfloat16 have no MPI datatype:
they move as 16-bit words and are reduced in float32. bool reduces through
MPI's logical ops.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

import torch

import hpdl.settings as settings
from hpdl.comm import mpi_calls
from hpdl.comm.env import env_number
from hpdl.errors import BackendUnavailableError

try:
    from mpi4py import MPI
except ImportError as _exc:  # pragma: no cover - exercised only without mpi4py
    raise BackendUnavailableError(
        f"the mpi backend needs mpi4py ({_exc}); install it with `pip install mpi4py mpich` "
        "(or build mpi4py against your cluster's MPI: `pip install --no-binary mpi4py mpi4py`)"
    ) from None

__all__ = ["MPI", "cuda_aware", "library_version", "node_comm"]

MOVE_TYPES = {
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.float16: MPI.UINT16_T,
    torch.bfloat16: MPI.UINT16_T,
    torch.int8: MPI.INT8_T,
    torch.uint8: MPI.UINT8_T,
    torch.int16: MPI.INT16_T,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.bool: MPI.C_BOOL,
    torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX,
}
"""The MPI datatype each torch dtype moves as."""
for _name, _mpi in (("uint16", MPI.UINT16_T), ("uint32", MPI.UINT32_T), ("uint64", MPI.UINT64_T)):
    if hasattr(torch, _name):
        MOVE_TYPES[getattr(torch, _name)] = _mpi

NATIVE = {dtype: mpi for dtype, mpi in MOVE_TYPES.items() if dtype not in (torch.float16, torch.bfloat16, torch.bool)}
"""dtypes whose MPI datatype reduces them directly (16-bit floats go through float32, bool through LOR/LAND)."""
OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
BOOL_OPS = {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "prod": MPI.LAND}
HALF = (torch.float16, torch.bfloat16)


def library_version() -> str:
    """The MPI library's name and version from its own version text (for example 'MPICH 5.0.2')."""
    first = MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0]  # Open MPI's ends in a NUL
    return " ".join(first.replace("Version:", "").split())


def cuda_aware() -> bool:
    """Whether the MPI library accepts CUDA device pointers (HPDL_MPI_CUDA_AWARE=0/1 overrides)."""
    forced = settings.read("HPDL_MPI_CUDA_AWARE")
    if forced is not None:
        return bool(forced)
    open_mpi = MPI.get_vendor()[0] == "Open MPI"
    for path in _loaded_mpi_libraries():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, "ompi_mpi_comm_self") != open_mpi:
            # another MPI mapped beside the running one (hpdl's compiled calls, linked to it, stood aside): asked, an
            # uninitialised MPICH ends the process ("Attempting to use an MPI routine before initializing")
            continue
        if hasattr(lib, "MPIX_Query_cuda_support"):  # Open MPI, MVAPICH2
            return bool(lib.MPIX_Query_cuda_support())
        if hasattr(lib, "MPIX_GPU_query_support"):  # MPICH >= 4
            flag = ctypes.c_int(0)
            lib.MPIX_GPU_query_support(ctypes.c_int(0), ctypes.byref(flag))  # 0: MPIX_GPU_SUPPORT_CUDA
            return bool(flag.value)
    return False


def _loaded_mpi_libraries() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libmpi" in line and ".so" in line}
    except OSError:
        return []
    return sorted(paths)


def node_comm(mpi_comm: Any) -> Any:
    """The ranks of `mpi_comm` that share this node's memory (caller frees it).

    HPDL_RANKS_PER_NODE=k cuts each node into virtual nodes of k ranks, so
    that multi-node code paths can be tested on one machine.
    """
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
    k = env_number("HPDL_RANKS_PER_NODE", 0, int, "a positive int")
    if not k:
        return node
    virtual = node.Split(node.Get_rank() // k, node.Get_rank())
    node.Free()
    return virtual


def memory(t: torch.Tensor) -> Any:
    return mpi_calls.memory_at(t.data_ptr(), t.numel() * t.element_size())


def buffer(t: torch.Tensor, dtype: Any) -> list:
    """[memory, datatype]: mpi4py derives the count (per rank where the call needs it) from the length."""
    return [memory(t), dtype]


def move_type(t: torch.Tensor, op: str) -> Any:
    try:
        return MOVE_TYPES[t.dtype]
    except KeyError:
        raise TypeError(f"{op}: dtype {t.dtype} is not supported on the mpi backend") from None


def reduce_op(t: torch.Tensor, op: str) -> Any:
    return BOOL_OPS[op] if t.dtype == torch.bool else OPS[op]


def output(out: Optional[torch.Tensor], engine_side: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The buffer MPI writes into: the caller's `out` when MPI can use it directly, else a new one."""
    if out is not None and out.device == engine_side.device and out.dtype == dtype:
        return out
    return torch.empty(shape, dtype=dtype, device=engine_side.device)


def deliver(
    result: torch.Tensor, out: Optional[torch.Tensor], device: torch.device, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """Hand the engine's result back on the caller's device and dtype (into `out` when given)."""
    if out is not None:
        return out if result is out else out.copy_(result)
    return result.to(device=device, dtype=dtype or result.dtype)


def copy_back(t: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    if host is not t:
        t.copy_(host)
    return t
