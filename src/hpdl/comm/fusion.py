"""Tensor fusion: many small tensors packed into few flat buffers, one engine call per buffer.

Every collective pays a fixed latency (alpha in the alpha-beta model); 200
gradients of 4 KB sent one by one pay it 200 times. Packing them into
buffers of up to `bucket_mb` megabytes pays it once per buffer (Horovod's
tensor fusion, DDP's buckets).

Training reduces the same tensors every step, so the layout (which tensor
goes where in which flat buffer) is planned once and kept: later calls with
the same tensors only run one `torch.cat(..., out=flat)` and one foreach
copy per buffer, about half a microsecond per tensor; on CPU, where the build
compiled `_copies.c`, one loop of memcpy over a table of addresses instead
(about 6x faster for 200 tensors of 4 KB).
"""

from __future__ import annotations

import importlib
import operator
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

from hpdl.comm.env import env_flag, env_number

try:
    if not env_flag("HPDL_COMPILED", True):
        raise ImportError("HPDL_COMPILED=0")
    _copies: Any = importlib.import_module("hpdl.comm._copies")  # (a C module: no import edge to hpdl.comm)
except ImportError:  # not built (no C compiler at install): torch's cat and foreach copy
    _copies = None

__all__: list[str] = []

DEFAULT_BUCKET_MB = 64.0
PLANS_KEPT = 8
"""Layouts remembered (least recently used dropped); each keeps its tensors and flat buffers alive."""


def bucket_bytes(bucket_mb: Optional[float]) -> int:
    if bucket_mb is None:
        bucket_mb = env_number("HPDL_FUSION_MB", DEFAULT_BUCKET_MB, float, "a number of megabytes")
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb={bucket_mb} must be positive (megabytes per fused buffer)")
    return int(bucket_mb * 1024 * 1024)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.view(-1)


@dataclass
class Bucket:
    """Tensors of one dtype and device that travel together in `flat`."""

    targets: list[torch.Tensor]
    """The tensors, viewed flat (same memory as the caller's)."""
    flat: torch.Tensor
    chunks: tuple[torch.Tensor, ...] = field(default=())
    table: Optional[bytes] = None
    """(address, bytes) of each target for the compiled copies (CPU buckets where they were built). The plan
    keeps the targets alive and is found again only by their current addresses and sizes."""
    disjoint: bool = True
    """No tensor of the whole call shares memory with another: a bucket may then be reduced piece by piece straight
    from and into its tensors (with a tensor twice, or overlapping views, a later piece would read values an
    earlier piece already wrote back)."""

    def __post_init__(self) -> None:
        if len(self.targets) > 1:
            self.chunks = self.flat.split([t.numel() for t in self.targets])
            # (not for tensors autograd tracks: torch.cat would refuse them, and its version counters must move)
            if _copies is not None and self.flat.is_cpu and not any(t.requires_grad for t in self.targets):
                self.table = table_of(self.targets)

    def fill(self) -> None:
        """Copy the tensors into the flat buffer (nothing to do for a tensor that is its own buffer)."""
        if self.table is not None:
            _copies.pack(self.flat.data_ptr(), self.table)
        elif len(self.targets) > 1:
            torch.cat(self.targets, out=self.flat)

    def unpack(self) -> None:
        """Copy the (reduced) flat buffer back into the tensors."""
        if self.table is not None:
            _copies.unpack(self.flat.data_ptr(), self.table)
            self.modified()
        elif len(self.targets) > 1:
            torch._foreach_copy_(self.targets, self.chunks)

    @property
    def packs_ranges(self) -> bool:
        """Whether the bucket may be reduced with `pack_range` and `unpack_range` (a CPU bucket with the compiled
        copies, whose tensors share memory with no other tensor of the call)."""
        return self.table is not None and self.disjoint

    def pack_range(self, address: int, start: int, length: int) -> None:
        """Copy bytes [start, start + length) of the tensors' concatenation to `address` (not the flat buffer)."""
        pack_range(self.table, address, start, length)  # type: ignore[arg-type]

    def unpack_range(self, address: int, start: int, length: int) -> None:
        """Copy `length` bytes at `address` into bytes [start, start + length) of the tensors' concatenation."""
        unpack_range(self.table, address, start, length)  # type: ignore[arg-type]

    def modified(self) -> None:
        """What torch's own copies do after writing the tensors: one saved for backward must not look unchanged."""
        _modified(self.targets)


def table_of(tensors: Sequence[torch.Tensor]) -> bytes:
    """The compiled copies' table of contiguous CPU tensors: (address, bytes) of each, in order."""
    return array("q", [value for t in tensors for value in (t.data_ptr(), t.numel() * t.element_size())]).tobytes()


def summed_in_place(dtype: torch.dtype) -> bool:
    """Whether `reduce_range` sums tensors of `dtype` (float32 and float64, where the build compiled it)."""
    return _copies is not None and dtype in _REDUCE_KINDS


def reduce_range(
    table: bytes,
    dtype: torch.dtype,
    start: int,
    length: int,
    out: Union[int, tuple[int, ...]],
    sources: tuple[int, ...],
    divisor: int,
    assign: bool = False,
) -> None:
    """Bytes [start, start + length) of the table's tensors summed in place with `length` bytes at each of
    `sources` (in that order), divided by `divisor` (1: a sum), and also written to address `out` (0: not) or to
    each address of a tuple; with `assign` the tensors receive the sum of the sources alone (their own values are
    not an operand)."""
    _copies.reduce(table, start, length, out, sources, _REDUCE_KINDS[dtype], divisor, assign)


def pack_range(table: bytes, address: int, start: int, length: int) -> None:
    """Copy bytes [start, start + length) of the table's tensors' concatenation to `address`."""
    _copies.pack(address, table, start, length)


def unpack_range(table: bytes, address: int, start: int, length: int) -> None:
    """Copy `length` bytes at `address` into bytes [start, start + length) of the table's tensors' concatenation."""
    _copies.unpack(address, table, start, length)


_REDUCE_KINDS = {torch.float32: 0, torch.float64: 1}
"""The dtypes `_copies.reduce` sums (its KIND_ numbers)."""


def _modified(tensors: list[torch.Tensor]) -> None:
    if _TAKES_A_LIST:
        torch.autograd.graph.increment_version(tensors)  # 17 us for 200 tensors
    else:
        for t in tensors:
            torch.autograd.graph.increment_version(t)


def _takes_a_list() -> bool:
    """Whether this torch's increment_version takes a list (from torch 2.5; before, one tensor at a time)."""
    try:
        torch.autograd.graph.increment_version([])
    except (TypeError, RuntimeError):  # torch 2.4: "increment_version expect a Tensor as input"
        return False
    return True


_TAKES_A_LIST = _takes_a_list()


@dataclass
class Plan:
    buckets: list[Bucket]
    numels: list[int]
    busy: bool = False
    nbytes: int = 0
    """Bytes of all the tensors together."""
    tensors: tuple = ()
    """The caller's tensor objects (kept alive: their ids cannot be reused while the plan is remembered)."""
    pointers: list[int] = field(default_factory=list)
    limit_bytes: int = 0
    dtype_list: list[torch.dtype] = field(init=False)
    dtypes: frozenset = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(bucket.flat.numel() * bucket.flat.element_size() for bucket in self.buckets)
        self.dtype_list = list(map(_DTYPE, self.tensors))
        self.dtypes = frozenset(self.dtype_list)

    def holds(self, tensors: Sequence[Any], limit_bytes: int) -> bool:
        """Whether `tensors` are this plan's own tensor objects, unmoved, unresized, of the same dtype (what a
        lookup compares, without building and hashing a key: an `is` per tensor instead)."""
        return (
            not self.busy and limit_bytes == self.limit_bytes and len(tensors) == len(self.tensors)
            and all(map(operator.is_, tensors, self.tensors))
            and list(map(_DATA_PTR, tensors)) == self.pointers and list(map(_NUMEL, tensors)) == self.numels
            and list(map(_DTYPE, tensors)) == self.dtype_list
        )  # fmt: skip


_DATA_PTR = torch.Tensor.data_ptr
_NUMEL = torch.Tensor.numel
_DTYPE = operator.attrgetter("dtype")


class Packer:
    """Plans and remembers fusion layouts for the lists of tensors a communicator reduces."""

    def __init__(self) -> None:
        self._plans: OrderedDict[tuple, Plan] = OrderedDict()
        self._last: Optional[Plan] = None

    def again(self, tensors: Sequence[Any], limit_bytes: int) -> Optional[Plan]:
        """The last plan when called again with the very same tensors (a training loop's gradients reduced in
        place step after step: the caller's checks of the tensors held when it was made); else None."""
        plan = self._last
        if plan is None or type(tensors) not in (list, tuple) or not plan.holds(tensors, limit_bytes):
            return None
        return plan

    def acquire(self, tensors: Sequence[torch.Tensor], limit_bytes: int) -> Plan:
        """A plan for these tensors (remembered or new): mark it `busy` while its buckets are in flight, clear it after
        unpacking."""
        # A plan holds views of its tensors, so their memory cannot be reused by
        # others while it is remembered: equal addresses and sizes mean the same tensors.
        pointers = list(map(_DATA_PTR, tensors))  # C-level maps: ~0.1 us a tensor
        key = (limit_bytes, *pointers, *map(_DTYPE, tensors))
        plan = self._plans.get(key)
        numels = list(map(_NUMEL, tensors))
        if plan is not None and plan.numels != numels:
            plan = None  # resized in place
        if plan is None or plan.busy:  # new tensors, or the same ones still in flight
            plan = Plan(pack(tensors, limit_bytes), numels, tensors=tuple(tensors), pointers=pointers,
                        limit_bytes=limit_bytes)  # fmt: skip
            if key not in self._plans:
                self._plans[key] = plan
                if len(self._plans) > PLANS_KEPT:
                    self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
            plan.tensors = tuple(tensors)  # maybe other objects on the same memory (new gradients): `again` looks
        self._last = plan
        return plan


def pack(tensors: Sequence[torch.Tensor], limit_bytes: int) -> list[Bucket]:
    """Group tensors by (dtype, device) in order into flat buffers of at most `limit_bytes` (not filled yet).

    A tensor larger than the limit gets a buffer of its own, which is the
    tensor itself (viewed flat, no copy).
    """
    runs: dict[object, list[list[torch.Tensor]]] = {}
    filled: dict[object, int] = {}
    for t in tensors:
        key = t.dtype if t.is_cpu else (t.dtype, t.device)
        nbytes = t.numel() * t.element_size()
        if key not in runs or filled[key] + nbytes > limit_bytes:
            runs.setdefault(key, []).append([])
            filled[key] = 0
        runs[key][-1].append(_flat(t))
        filled[key] += nbytes
    buckets = []
    disjoint = _disjoint(tensors)
    for groups in runs.values():
        for run in groups:
            if len(run) == 1:
                buckets.append(Bucket(run, run[0], disjoint=disjoint))
            elif run:
                total = sum(t.numel() for t in run)
                flat = torch.empty(total, dtype=run[0].dtype, device=run[0].device)
                buckets.append(Bucket(run, flat, disjoint=disjoint))
    return buckets


def _disjoint(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether no two CPU tensors share a byte (once per plan: sorted by address)."""
    spans = sorted((t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.is_cpu and t.numel())
    return all(start + nbytes <= following for (start, nbytes), (following, _) in zip(spans, spans[1:]))
