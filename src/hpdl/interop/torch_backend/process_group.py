# mypy: disable-error-code="override,assignment,misc"
# (torch's stubs type ProcessGroup's methods as the overloads of its Python API; the trampoline calls these, and
# the shared collectives' class then "conflicts" with them.)
"""`HpdlProcessGroup` and `HpdlBackend`: torch process groups and backends whose collectives run on an hpdl
`Communicator`.

torch replaces its own process group by any `ProcessGroup` subclass a
registered backend returns, and its C++ side (DDP's reducer, functional
collectives, DTensor) reaches these Python methods through the pybind
trampoline; `torch.distributed`'s Python functions call them directly. From
torch 2.14 a Python subclass of torch's C++ `Backend` is reached the same way
(its `PyBackend` trampoline) and sits in torch's own group for the devices it
was asked for, beside another backend ("cpu:hpdl,cuda:nccl"). Both classes
share the collectives (`HpdlCollectives`): each method starts the operation
at once on the communicator and returns an `HpdlWork` (see progress.py for
who completes it).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from hpdl.comm.base import Communicator
from hpdl.interop.import_hooks import when_imported
from hpdl.interop.torch_backend import buffer_pool, ops
from hpdl.interop.torch_backend.progress import Started, progress
from hpdl.interop.torch_backend.work import HpdlWork

__all__ = ["HpdlProcessGroup", "HpdlBackend", "BackendCapabilities", "python_backends"]

SERVED_DEVICES = ("cpu", "cuda")
"""The device types whose tensors the group takes (CUDA ones through CUDA-aware MPI or staged via the host)."""


class BackendCapabilities:
    """What `group._get_backend(device)` answers for an hpdl group: the capability flags torch's Python code reads
    before it picks a path. A Python group has no C++ backend registered, so torch's own `_get_backend` raised
    "No backend type associated with device type cpu", and torch 2.14's `batch_isend_irecv` (which
    torch.distributed.pipelining uses) asks it for `supports_coalescing` without catching that. hpdl's group does
    every operation itself: none of NCCL's extras (coalescing managers, splitting, shrinking). Its allocator is
    a pool of reused CPU buffers (buffer_pool.py), which FSDP2 asks for its communication buffers where the program
    calls `set_allocate_memory_from_process_group_for_comm(True)`."""

    supports_coalescing = False
    supports_splitting = False
    supports_shrinking = False
    supports_time_estimate = False

    def name(self) -> str:
        return "hpdl"

    def supports_tensor_alloc(self, device: Any) -> bool:
        return torch.device(device).type == "cpu" and buffer_pool.pool.enabled

    def allocate_tensor(self, size: int, *, dtype: torch.dtype, device: Any) -> torch.Tensor:
        if torch.device(device).type != "cpu":
            return torch.empty(size, dtype=dtype, device=device)
        return buffer_pool.pool.allocate(size, dtype)


_CAPABILITIES = BackendCapabilities()
"""The same answer for every group: nothing in it depends on the group."""


class HpdlCollectives:
    """The collectives of an hpdl group or backend, on `self.comm` (an hpdl MPI communicator of exactly the
    group's ranks)."""

    comm: Communicator

    # collectives ------------------------------------------------------------------------
    def _submit(self, start: Callable[[], Started], outputs: Any, p2p: bool = False) -> HpdlWork:
        return progress.submit(self.comm, start, HpdlWork(outputs), p2p)

    def allreduce(self, tensors: list, opts: Any = None) -> HpdlWork:
        opts = opts if opts is not None else dist.AllreduceOptions()
        if len(tensors) == 1:
            t, op = tensors[0], ops.plain_op(opts.reduceOp)
            if op is not None and t.is_cpu and t.is_contiguous():
                comm, blocking = self.comm, not getattr(opts, "asyncOp", True)  # (said by torch >= 2.6)
                return progress.submit_one(
                    comm, lambda: comm.allreduce(t, op, async_op=True), HpdlWork(tensors), t.nbytes, blocking=blocking,
                    briefly=lambda: comm.start_briefly("allreduce", t, op),
                )  # fmt: skip
        return self._submit(lambda: ops.allreduce(self.comm, tensors, opts), tensors)

    def allreduce_coalesced(self, tensors: list, opts: Any = None) -> HpdlWork:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._submit(lambda: ops.allreduce_coalesced(self.comm, tensors, opts), tensors)

    def reduce(self, tensors: list, opts: Any = None) -> HpdlWork:
        opts = opts if opts is not None else dist.ReduceOptions()
        return self._submit(lambda: ops.reduce(self.comm, tensors, opts), tensors)

    def broadcast(self, tensors: list, opts: Any = None) -> HpdlWork:
        opts = opts if opts is not None else dist.BroadcastOptions()
        if len(tensors) == 1 and tensors[0].is_cpu and tensors[0].is_contiguous():
            t, root, comm, blocking = tensors[0], opts.rootRank, self.comm, not getattr(opts, "asyncOp", True)
            return progress.submit_one(
                comm, lambda: comm.broadcast(t, root, async_op=True), HpdlWork(tensors), t.nbytes, blocking=blocking,
                briefly=lambda: comm.start_briefly("broadcast", t, root),
            )  # fmt: skip
        return self._submit(lambda: ops.broadcast(self.comm, tensors, opts), tensors)

    def allgather(self, output_lists: list, inputs: list, opts: Any = None) -> HpdlWork:
        return self._submit(lambda: ops.allgather(self.comm, output_lists, inputs, opts), output_lists)

    def allgather_coalesced(self, output_lists: list, inputs: list, opts: Any = None) -> HpdlWork:
        return self._submit(lambda: ops.allgather_coalesced(self.comm, output_lists, inputs, opts), output_lists)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> HpdlWork:
        return self._submit(lambda: ops.all_gather_single(self.comm, output, input, opts), [output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> HpdlWork:
        return self._submit(lambda: ops.all_gather_single_coalesced(self.comm, outputs, inputs, opts), outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs: list, input_lists: list, opts: Any = None) -> HpdlWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._submit(lambda: ops.reduce_scatter(self.comm, outputs, input_lists, opts), outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> HpdlWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._submit(lambda: ops.reduce_scatter_single(self.comm, output, input, opts), [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list, inputs: list, opts: Any = None) -> HpdlWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        return self._submit(lambda: ops.reduce_scatter_single_coalesced(self.comm, outputs, inputs, opts), outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def gather(self, output_lists: list, inputs: list, opts: Any = None) -> HpdlWork:
        opts = opts if opts is not None else dist.GatherOptions()
        return self._submit(lambda: ops.gather(self.comm, output_lists, inputs, opts), output_lists)

    def scatter(self, outputs: list, input_lists: list, opts: Any = None) -> HpdlWork:
        opts = opts if opts is not None else dist.ScatterOptions()
        return self._submit(lambda: ops.scatter(self.comm, outputs, input_lists, opts), outputs)

    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list, input_splits: list, opts: Any = None
    ) -> HpdlWork:
        return self._submit(
            lambda: ops.all_to_all_single(self.comm, output, input, output_splits, input_splits, opts), [output]
        )

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list, inputs: list, opts: Any = None) -> HpdlWork:
        return self._submit(lambda: ops.alltoall(self.comm, outputs, inputs, opts), outputs)

    def barrier(self, opts: Any = None) -> HpdlWork:
        return self._submit(lambda: ops.barrier(self.comm, opts), [])

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """A barrier whose timeout names the ranks that did not arrive (like every hpdl wait)."""
        self.barrier().wait()

    # point-to-point -----------------------------------------------------------------------
    def send(self, tensors: list, dst: int, tag: int = 0) -> HpdlWork:
        return self._submit(lambda: ops.send(self.comm, tensors, dst, tag), tensors, p2p=True)

    def recv(self, tensors: list, src: int, tag: int = 0) -> HpdlWork:
        return self._submit(lambda: ops.recv(self.comm, tensors, src, tag), tensors, p2p=True)

    def recv_anysource(self, tensors: list, tag: int = 0) -> HpdlWork:
        """`dist.recv(t)` / `irecv(t)` without `src`: the next message with `tag` from any rank."""
        work = HpdlWork(tensors)

        def start() -> Started:
            parts, finish = ops.recv(self.comm, tensors, None, tag)

            def note_the_sender() -> None:
                work.sender = parts[0].source
                finish()

            return parts, note_the_sender

        return progress.submit(self.comm, start, work, p2p=True)

    # life cycle ------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Free the group's communicator (destroy_process_group calls this on every member)."""
        progress.call(self.comm.close)
        progress.forget(self.comm)
        buffer_pool.pool.clear()  # the waiting buffers go back to the system, those in use as they return

    def abort(self) -> None:
        self.comm._broken = True


class HpdlProcessGroup(HpdlCollectives, dist.ProcessGroup):
    """A torch process group over `comm` (an hpdl MPI communicator of exactly this group's ranks).

    `comm` is public: attach a tracer (`group.comm.tracer = Tracer()`) or
    change the timeout there.
    """

    def __init__(self, comm: Communicator, global_ranks: list[int]):
        super().__init__(comm.rank, comm.size)  # type: ignore[call-arg]  # the (rank, size) overload
        self.comm = comm
        self.global_ranks = global_ranks
        self._group_name = ""
        self._group_desc = ""

    # identity -------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return "hpdl"

    def _get_backend(self, device: Any) -> BackendCapabilities:
        kind = torch.device(device).type
        if kind not in SERVED_DEVICES:
            raise RuntimeError(f"No backend type associated with device type {kind}")  # torch's own words
        return _CAPABILITIES

    # torch names every group (functional collectives find it by name); a backend-less Python group keeps it
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def __repr__(self) -> str:
        return f"<hpdl process group rank {self.comm.rank} of {self.comm.size} (global ranks {self.global_ranks})>"


def python_backends() -> bool:
    """Whether this torch reaches a Python subclass of its C++ `Backend` (its `PyBackend` trampoline, torch 2.14):
    only then can hpdl sit beside another backend in one group."""
    from hpdl.runtime.environment import torch_release

    return torch_release() >= (2, 14)


def backend_class() -> type:
    """`HpdlBackend`, made on first use (on a torch before 2.14 the C++ `Backend` would never call its methods, and
    `import hpdl` must not depend on torch.distributed's internals)."""
    global HpdlBackend
    if HpdlBackend is None:
        from torch._C._distributed_c10d import Backend

        class _HpdlBackend(HpdlCollectives, Backend):  # type: ignore[misc]
            """hpdl as one device's backend of a torch group ("cpu:hpdl,cuda:nccl": torch's group sends CPU
            tensors here and CUDA tensors to NCCL). `comm` is public, as on `HpdlProcessGroup`."""

            def __init__(self, comm: Communicator, global_ranks: list[int]):
                super().__init__(comm.rank, comm.size)
                self.comm = comm
                self.global_ranks = global_ranks

            def getBackendName(self) -> str:
                return "hpdl"

            def supports_tensor_alloc(self, device: Any) -> bool:  # (torch's C++ side passes a device index)
                return _CAPABILITIES.supports_tensor_alloc("cpu" if isinstance(device, int) else device)

            def allocate_tensor(self, size: int, *, dtype: torch.dtype, device: Any) -> torch.Tensor:
                return _CAPABILITIES.allocate_tensor(size, dtype=dtype, device=device)

            def __repr__(self) -> str:
                return f"<hpdl backend rank {self.comm.rank} of {self.comm.size} (global ranks {self.global_ranks})>"

        _HpdlBackend.__name__ = _HpdlBackend.__qualname__ = "HpdlBackend"
        HpdlBackend = _HpdlBackend
        _disable_dynamo_in_methods()
    return HpdlBackend


HpdlBackend: Any = None
"""The class `backend_class()` makes (None until then)."""


def _guard_from_compile() -> None:
    """Keep torch.compile (dynamo) out of the backend's methods, once dynamo is loaded (too heavy to load here):
    a group made before `torch.compile(ddp)` is first called is guarded too."""
    when_imported("torch._dynamo", _disable_dynamo_in_methods)


def _disable_dynamo_in_methods() -> None:
    if "torch._dynamo" not in sys.modules:  # (backend_class calls this too: only once dynamo is loaded)
        return
    for cls in (HpdlCollectives, HpdlProcessGroup, HpdlBackend):
        for name, value in list(vars(cls).items()) if cls is not None else ():
            if callable(value) and not name.startswith("__") and not getattr(value, "_torchdynamo_disable", False):
                setattr(cls, name, torch.compiler.disable(value))
