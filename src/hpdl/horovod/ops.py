"""Horovod's collectives on tensors: allreduce, allgather, broadcast, alltoall, reducescatter (each plain,
grouped, `_async` and, where Horovod has it, in place), barrier, join, poll and synchronize.

Every operation is a named request of `hpdl.horovod.engine` (matched by
name, checked for agreement on every rank). The differentiable forms
(`allreduce`, `allgather`, `broadcast`, `alltoall`, `reducescatter` and the
grouped ones) have Horovod's gradients.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from hpdl.comm.work import Work
from hpdl.horovod import adasum, basics, engine
from hpdl.horovod.basics import Adasum, Average, Sum, check_op
from hpdl.horovod.compression import Compression
from hpdl.horovod.engine import DTYPES, Finish, Request, Round, bits_float, dtype_code, float_bits
from hpdl.horovod.process_sets import ProcessSet, global_process_set, resolve

__all__ = [
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "sparse_allreduce_async",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "barrier",
    "join",
    "poll",
    "synchronize",
]


# --------------------------------------------------------------------------- helpers
def _check_tensor(t: Any, op: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        raise ValueError(f"{op}: sparse tensors go through hvd.sparse_allreduce_async (or to_dense())")
    dtype_code(t, op)
    return t


def _shape_fields(tensors: Sequence[torch.Tensor], tail_only: bool) -> list[int]:
    out = [len(tensors)]
    for t in tensors:
        shape = list(t.shape[1:] if tail_only else t.shape)
        out += [dtype_code(t, "collective"), len(shape), *shape]
    return out


def _parse_shapes(fields: list[int]) -> list[tuple[str, tuple[int, ...]]]:
    n, pos, out = fields[0], 1, []
    for _ in range(n):
        dtype, ndim = DTYPES[fields[pos]], fields[pos + 1]
        out.append((str(dtype).replace("torch.", ""), tuple(fields[pos + 2 : pos + 2 + ndim])))
        pos += 2 + ndim
    return out


def _shape_labels(offset: int, tail_only: bool) -> list[tuple[str, Callable[[list[int]], Any]]]:
    what = "shape (past the first dimension)" if tail_only else "shape"
    return [
        ("number of tensors", lambda c: c[offset]),
        ("dtype", lambda c: [d for d, _ in _parse_shapes(c[offset:])]),
        (what, lambda c: [s for _, s in _parse_shapes(c[offset:])]),
    ]


def _scale(t: torch.Tensor, factor: float) -> None:
    """Horovod's scale factors on CPU: integers in float64 (truncated back), float16/bfloat16 in float32,
    floating types in their own precision."""
    if factor == 1.0:
        return
    if t.dtype in (torch.float32, torch.float64) or t.dtype.is_complex:
        t.mul_(factor)
    elif t.dtype.is_floating_point:
        t.copy_(t.float() * torch.tensor(factor, dtype=torch.float32))
    else:
        t.copy_((t.double() * factor).to(t.dtype))


def _divide(t: torch.Tensor, divisor: int, factor: float) -> None:
    """Average's division by the set's size and the postscale factor, in float64, rounded once."""
    if t.dtype == torch.float64 or t.dtype.is_complex:
        t.mul_(factor / divisor)
    else:  # one float64 copy, divided in place (the same bits as out-of-place, 1.5-2.3x faster: no temporaries)
        t.copy_(t.double().div_(divisor).mul_(factor))


def _needs_grad(t: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and t.requires_grad


def _submit(request: Request) -> int:
    return engine.submit(request)


def _name(name: Optional[str], op: str) -> Optional[str]:
    if name is not None and not isinstance(name, str):
        raise ValueError(f"{op}: name={name!r} must be a string")
    return name


# --------------------------------------------------------------------------- allreduce
_REDUCE_LABELS = [
    ("op", lambda c: basics.op_name(c[0])),
    ("prescale_factor", lambda c: bits_float(c[1])),
    ("postscale_factor", lambda c: bits_float(c[2])),
    *_shape_labels(3, False),
]


def _allreduce_request(
    kind_name: str,
    tensors: list[torch.Tensor],
    outputs: list[torch.Tensor],
    name: Optional[str],
    op: int,
    prescale_factor: float,
    postscale_factor: float,
    process_set: Optional[ProcessSet],
) -> int:
    ps = resolve(process_set, kind_name)
    n = ps.size() or 1
    for t in tensors:
        _check_tensor(t, kind_name)
        if t.dtype == torch.bool or (t.dtype.is_complex and op in (basics.Min, basics.Max)):
            raise ValueError(f"{kind_name}: op={basics.op_name(op)} is not supported for {t.dtype}")
    if op == Adasum:
        adasum.check(tensors, ps, n)
    for out, t in zip(outputs, tensors):
        if out is not t:
            out.copy_(t)
        _scale(out, float(prescale_factor))
    common = [op, float_bits(prescale_factor), float_bits(postscale_factor), *_shape_fields(tensors, False)]

    def launch(rnd: Round, req: Request) -> Callable[[], Any]:
        comm = rnd.comm
        if op == Adasum:
            fused = adasum.launch(comm, outputs, postscale_factor)
            return Finish(fused.works, lambda: fused()[0] if kind_name == "allreduce" else fused())
        engine_op = basics.ENGINE_OPS[op]
        if len(outputs) == 1:
            works = [comm.allreduce(outputs[0], engine_op, async_op=True)]
        else:
            works = [comm.allreduce_coalesced(outputs, engine_op, async_op=True)]

        def finish() -> Any:
            for out in outputs:
                if op == Average:
                    _divide(out, comm.size, float(postscale_factor))
                else:
                    _scale(out, float(postscale_factor))
            return outputs[0] if kind_name == "allreduce" else list(outputs)

        return Finish(works, finish)

    key = engine.make_key("allreduce", name, ps)
    return _submit(Request(key, "allreduce", common, _REDUCE_LABELS, [], launch, ps))


def _in_place_buffer(t: torch.Tensor, op: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"{op}: Tensor is required to be contiguous.")
    return t.detach()


def allreduce_async(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing a copy of `tensor` (default op: Average); `synchronize(handle)` returns it."""
    reduce_op = check_op(op, average)
    _check_tensor(tensor, "allreduce")
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return _allreduce_request(
        "allreduce", [out], [out], _name(name, "allreduce"), reduce_op,
        prescale_factor, postscale_factor, process_set,
    )  # fmt: skip


def allreduce_async_(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing `tensor` in place; `synchronize(handle)` returns it."""
    reduce_op = check_op(op, average)
    _check_tensor(tensor, "allreduce_")
    buf = _in_place_buffer(tensor, "allreduce_")
    return _allreduce_request(
        "allreduce", [buf], [buf], _name(name, "allreduce_"), reduce_op, prescale_factor, postscale_factor, process_set
    )


class HorovodAllreduce(torch.autograd.Function):
    """allreduce with a gradient: the gradient is the same allreduce of the incoming gradient."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):  # type: ignore[override]
        ctx.average, ctx.op, ctx.process_set = average, op, process_set
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set))

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        grad = allreduce(
            grad_output, average=ctx.average, op=ctx.op, prescale_factor=ctx.prescale_factor,
            postscale_factor=ctx.postscale_factor, process_set=ctx.process_set,
        )  # fmt: skip
        return grad, None, None, None, None, None, None


def allreduce(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """The reduction of `tensor` across the set (default: the average), as a new tensor; differentiable."""
    compressed, ctx = compression.compress(tensor)
    if _needs_grad(compressed):
        reduced = HorovodAllreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    else:  # no graph to record: skip autograd's bookkeeping
        reduced = synchronize(
            allreduce_async(compressed, average, name, op, prescale_factor, postscale_factor, process_set)
        )
    return compression.decompress(reduced, ctx)


def allreduce_(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce `tensor` in place and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing copies of `tensors` as one operation (one name, fused on the wire)."""
    reduce_op = check_op(op, average)
    outs = [
        _check_tensor(t, "grouped_allreduce").detach().clone(memory_format=torch.contiguous_format) for t in tensors
    ]
    return _allreduce_request(
        "grouped_allreduce", outs, outs, _name(name, "grouped_allreduce"), reduce_op,
        prescale_factor, postscale_factor, process_set,
    )  # fmt: skip


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    reduce_op = check_op(op, average)
    bufs = [_in_place_buffer(_check_tensor(t, "grouped_allreduce_"), "grouped_allreduce_") for t in tensors]
    return _allreduce_request(
        "grouped_allreduce", bufs, bufs, _name(name, "grouped_allreduce_"), reduce_op,
        prescale_factor, postscale_factor, process_set,
    )  # fmt: skip


class HorovodGroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):  # type: ignore[override]
        ctx.average, ctx.op, ctx.process_set = average, op, process_set
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        handle = grouped_allreduce_async(
            list(tensors), average, name, op, prescale_factor, postscale_factor, process_set
        )
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx, *grad_output):  # type: ignore[override]
        grads = grouped_allreduce(
            list(grad_output), average=ctx.average, op=ctx.op, prescale_factor=ctx.prescale_factor,
            postscale_factor=ctx.postscale_factor, process_set=ctx.process_set,
        )  # fmt: skip
        return (None, None, None, None, None, None, *grads)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """The reductions of `tensors`, as new tensors, in one named operation; differentiable."""
    pairs = [compression.compress(t) for t in tensors]
    reduced = HorovodGroupedAllreduce.apply(
        average, name, op, prescale_factor, postscale_factor, process_set, *[p[0] for p in pairs]
    )
    return [compression.decompress(r, c) for r, (_, c) in zip(reduced, pairs)]


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Optional[int] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    return synchronize(
        grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    )


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: int, process_set: ProcessSet = global_process_set
) -> Callable[[], torch.Tensor]:
    """Reduce a sparse tensor by gathering every rank's indices and values; call the returned function
    for the result (Horovod's form). Average divides the values by the set's size."""
    if not tensor.is_sparse:
        raise ValueError("sparse_allreduce_async: the tensor is not sparse; use allreduce_async")
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices_handle = allgather_async(t._indices().transpose(0, 1).contiguous(), f"{name}.indices", process_set)
    values_handle = allgather_async(t._values().contiguous(), f"{name}.values", process_set)
    size = resolve(process_set, "sparse_allreduce_async").size() or 1

    def handle() -> torch.Tensor:
        values = synchronize(values_handle)
        indices = synchronize(indices_handle)
        if op == Average:
            values = values / size
        return torch.sparse_coo_tensor(indices.transpose(0, 1), values, t.size(), check_invariants=False)

    return handle


# --------------------------------------------------------------------------- allgather
def _allgather_request(kind_name: str, tensors: list[torch.Tensor], name: Optional[str], process_set: Any) -> int:
    ps = resolve(process_set, kind_name)
    bufs = []
    for t in tensors:
        _check_tensor(t, kind_name)
        b = t.detach().contiguous()
        bufs.append(b.reshape(1) if b.dim() == 0 else b)
    common = _shape_fields(bufs, True)
    varying = [b.shape[0] for b in bufs]

    def launch(rnd: Round, req: Request) -> Callable[[], Any]:
        dims = rnd.varying(req.hash, req.varying)
        works = []
        for i, b in enumerate(bufs):
            sizes = [d[i] if d is not None else 0 for d in dims]
            works.append(rnd.comm.allgather(b, sizes=sizes, async_op=True))

        def finish() -> Any:
            results = [w.wait() for w in works]
            return results[0] if kind_name == "allgather" else results

        return Finish(works, finish)

    key = engine.make_key("allgather", name, ps)
    return _submit(Request(key, "allgather", common, _shape_labels(0, True), varying, launch, ps))


def allgather_async(
    tensor: torch.Tensor, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start concatenating every rank's `tensor` along dim 0 (dim 0 may differ between ranks)."""
    return _allgather_request("allgather", [tensor], _name(name, "allgather"), process_set)


class HorovodAllgather(torch.autograd.Function):
    """allgather with a gradient: the averaged incoming gradient's slice that belongs to this rank."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):  # type: ignore[override]
        ctx.dim = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        grad_reduced = allreduce(grad_output, average=True, process_set=ctx.process_set)
        dims = allgather(torch.tensor([ctx.dim], dtype=torch.int32), process_set=ctx.process_set)
        r = ctx.process_set.rank()
        offset = int(dims[:r].sum()) if r else 0
        return grad_reduced.narrow(0, offset, ctx.dim), None, None


def allgather(tensor: torch.Tensor, name: Optional[str] = None, process_set: ProcessSet = global_process_set) -> Any:
    """Every rank's `tensor` concatenated along dim 0 (dim 0 may differ between ranks); differentiable."""
    if not _needs_grad(tensor):
        return synchronize(allgather_async(tensor, name, process_set))
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> int:
    return _allgather_request("grouped_allgather", list(tensors), _name(name, "grouped_allgather"), process_set)


class HorovodGroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):  # type: ignore[override]
        ctx.dims = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.process_set = process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grad_output):  # type: ignore[override]
        reduced = grouped_allreduce(list(grad_output), average=True, process_set=ctx.process_set)
        dims = grouped_allgather([torch.tensor([d], dtype=torch.int32) for d in ctx.dims], process_set=ctx.process_set)
        r = ctx.process_set.rank()
        out = []
        for g, d, mine in zip(reduced, dims, ctx.dims):
            offset = int(d[:r].sum()) if r else 0
            out.append(g.narrow(0, offset, mine))
        return (None, None, *out)


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> list[torch.Tensor]:
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


# --------------------------------------------------------------------------- broadcast
def _broadcast_request(buf: torch.Tensor, root_rank: int, name: Optional[str], process_set: Any) -> int:
    ps = resolve(process_set, "broadcast")
    _check_tensor(buf, "broadcast")
    if not isinstance(root_rank, int) or isinstance(root_rank, bool):
        raise ValueError(f"broadcast: root_rank={root_rank!r} must be an int (a world rank)")
    members = ps._ranks()
    if root_rank not in members:
        raise ValueError(f"broadcast: root_rank={root_rank} is not in {ps} (root_rank is a world rank)")
    root = members.index(root_rank)
    common = [root_rank, *_shape_fields([buf], False)]
    labels = [("root_rank", lambda c: c[0]), *_shape_labels(1, False)]

    def launch(rnd: Round, req: Request) -> Callable[[], Any]:
        work = rnd.comm.broadcast(buf, root, async_op=True)
        return Finish([work], lambda: buf)

    key = engine.make_key("broadcast", name, ps)
    return _submit(Request(key, "broadcast", common, labels, [], launch, ps))


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start broadcasting `root_rank`'s tensor into a new tensor on every rank (root_rank: a world rank)."""
    _check_tensor(tensor, "broadcast")
    buf = tensor.detach().clone(memory_format=torch.contiguous_format)
    return _broadcast_request(buf, root_rank, _name(name, "broadcast"), process_set)


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> int:
    """Start broadcasting `root_rank`'s tensor into `tensor` in place (also a leaf that requires grad)."""
    _check_tensor(tensor, "broadcast_")
    return _broadcast_request(_in_place_buffer(tensor, "broadcast_"), root_rank, _name(name, "broadcast_"), process_set)


class HorovodBroadcast(torch.autograd.Function):
    """broadcast with a gradient: the averaged incoming gradient on the root, zeros elsewhere."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):  # type: ignore[override]
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        grad = allreduce(grad_output, average=True, process_set=ctx.process_set)
        if basics.rank() != ctx.root_rank:
            grad = grad * 0
        return grad, None, None, None


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """`root_rank`'s tensor, as a new tensor on every rank; differentiable."""
    if not _needs_grad(tensor):
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Copy `root_rank`'s tensor into `tensor` in place and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# --------------------------------------------------------------------------- alltoall
def alltoall_async(
    tensor: torch.Tensor,
    splits: Any = None,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start sending `splits[j]` rows of `tensor` (in order) to member j; `synchronize` returns
    (received tensor, received splits). Without `splits`, dim 0 is split evenly."""
    ps = resolve(process_set, "alltoall")
    _check_tensor(tensor, "alltoall")
    n = ps.size() or 1
    buf = tensor.detach().contiguous()
    if buf.dim() == 0:
        raise ValueError("alltoall: the tensor needs at least one dimension")
    if splits is None:
        if buf.shape[0] % n:
            raise ValueError(f"alltoall: dim 0 ({buf.shape[0]}) is not a multiple of the set's size ({n}); pass splits")
        send = [buf.shape[0] // n] * n
    else:
        if isinstance(splits, torch.Tensor):
            if splits.dtype != torch.int32:
                raise ValueError(
                    f"alltoall: splits must be a tensor of 32-bit integers (torch.int32), got {splits.dtype}"
                )
            send = [int(s) for s in splits.tolist()]
        else:
            send = [int(s) for s in splits]
        if len(send) != n:
            raise ValueError(f"alltoall: splits has {len(send)} entries; the set has {n} members")
        if any(s < 0 for s in send) or sum(send) > buf.shape[0]:
            raise ValueError(f"alltoall: splits {send} must be non-negative and sum to at most dim 0 ({buf.shape[0]})")
    common = _shape_fields([buf], True)

    def launch(rnd: Round, req: Request) -> Callable[[], Any]:
        comm = rnd.comm
        table = [v if v is not None else [0] * n for v in rnd.varying(req.hash, req.varying)]
        me = comm.rank
        received = [table[j][me] for j in range(n)]
        tail = tuple(buf.shape[1:])
        widest = max(max(row) for row in table)
        uniform = all(s == widest for row in table for s in row)
        if uniform and sum(send) == buf.shape[0]:
            work = comm.alltoall(buf, async_op=True)
            return Finish([work], lambda: (work.wait(), torch.tensor(received, dtype=torch.int32)))
        padded = buf.new_zeros((n * widest, *tail))
        start = 0
        for j, s in enumerate(send):
            padded[j * widest : j * widest + s] = buf[start : start + s]
            start += s
        work = comm.alltoall(padded, async_op=True)

        def finish() -> Any:
            got = work.wait()
            parts = [got[j * widest : j * widest + received[j]] for j in range(n)]
            return torch.cat(parts) if parts else got[:0], torch.tensor(received, dtype=torch.int32)

        return Finish([work], finish)

    key = engine.make_key("alltoall", _name(name, "alltoall"), ps)
    return _submit(Request(key, "alltoall", common, _shape_labels(0, True), send, launch, ps))


class HorovodAlltoall(torch.autograd.Function):
    """alltoall with a gradient: the incoming gradient sent back along the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):  # type: ignore[override]
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.process_set, ctx.received = process_set, received
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *unused):  # type: ignore[override]
        grad, _ = alltoall(grad_output.contiguous(), splits=ctx.received, process_set=ctx.process_set)
        return grad, None, None, None


def alltoall(
    tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> Any:
    """The rows every member sent to this rank; with `splits`, also the received splits. Differentiable."""
    output, received = HorovodAlltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


# --------------------------------------------------------------------------- reducescatter
def _scatter_counts(dim0: int, n: int) -> list[int]:
    """Horovod's split of dim 0: as even as possible, the first ranks take one row more."""
    return [dim0 // n + (1 if r < dim0 % n else 0) for r in range(n)]


def _reducescatter_request(
    kind_name: str, tensors: list[torch.Tensor], name: Optional[str], op: int, process_set: Any,
    prescale_factor: float, postscale_factor: float,
) -> int:  # fmt: skip
    ps = resolve(process_set, kind_name)
    if op == Adasum:
        raise NotImplementedError(f"{kind_name}: Reducescatter does not support Adasum; use Sum or Average")
    if op not in (Average, Sum, basics.Min, basics.Max, basics.Product):
        raise ValueError(f"{kind_name}: op={op!r}: use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    bufs = []
    for t in tensors:
        _check_tensor(t, kind_name)
        if t.dim() == 0:
            raise ValueError(f"{kind_name}: a scalar cannot be scattered; pass a tensor with at least one dimension")
        b = t.detach().clone(memory_format=torch.contiguous_format)
        _scale(b, float(prescale_factor))
        bufs.append(b)
    common = [op, float_bits(prescale_factor), float_bits(postscale_factor), *_shape_fields(bufs, False)]

    def launch(rnd: Round, req: Request) -> Callable[[], Any]:
        comm = rnd.comm
        n, me = comm.size, comm.rank
        engine_op = basics.ENGINE_OPS[op]
        works: list[Work] = []
        slices: list[Optional[tuple[int, int]]] = []
        for b in bufs:
            counts = _scatter_counts(b.shape[0], n)
            if b.shape[0] % n == 0:
                works.append(comm.reduce_scatter(b, engine_op, async_op=True))
                slices.append(None)
            else:
                works.append(comm.allreduce(b, engine_op, async_op=True))
                slices.append((sum(counts[:me]), counts[me]))

        def finish() -> Any:
            outs = []
            for w, sl in zip(works, slices):
                out = w.wait()
                if sl is not None:
                    out = out.narrow(0, sl[0], sl[1]).clone()
                if op == Average:
                    _divide(out, n, float(postscale_factor))
                else:
                    _scale(out, float(postscale_factor))
                outs.append(out)
            return outs[0] if kind_name == "reducescatter" else outs

        return Finish(works, finish)

    key = engine.make_key("reducescatter", name, ps)
    return _submit(Request(key, "reducescatter", common, _REDUCE_LABELS, [], launch, ps))


def reducescatter_async(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reducing `tensor` across the set; this rank gets its share of dim 0 (the first ranks one row
    more when dim 0 does not divide evenly)."""
    return _reducescatter_request(
        "reducescatter", [tensor], _name(name, "reducescatter"), op, process_set, prescale_factor, postscale_factor
    )


class HorovodReducescatter(torch.autograd.Function):
    """reducescatter with a gradient: the incoming gradient gathered (scaled as the forward was)."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):  # type: ignore[override]
        ctx.op, ctx.process_set = op, process_set
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        grad = _reducescatter_grad(grad_output, ctx)
        return allgather(grad, process_set=ctx.process_set), None, None, None, None, None


def _reducescatter_grad(grad: torch.Tensor, ctx: Any) -> torch.Tensor:
    if ctx.op == Sum:
        grad = grad * ctx.process_set.size()
    if ctx.prescale_factor != 1.0:
        grad = grad * ctx.prescale_factor
    if ctx.postscale_factor != 1.0:
        grad = grad * ctx.postscale_factor
    return grad


def reducescatter(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """This rank's share of the reduction of `tensor` across the set (default: Average); differentiable."""
    compressed, ctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    return _reducescatter_request(
        "grouped_reducescatter", list(tensors), _name(name, "grouped_reducescatter"), op, process_set,
        prescale_factor, postscale_factor,
    )  # fmt: skip


class HorovodGroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):  # type: ignore[override]
        ctx.op, ctx.process_set = op, process_set
        ctx.prescale_factor, ctx.postscale_factor = prescale_factor, postscale_factor
        handle = grouped_reducescatter_async(list(tensors), name, op, process_set, prescale_factor, postscale_factor)
        return tuple(synchronize(handle))

    @staticmethod
    def backward(ctx, *grad_output):  # type: ignore[override]
        grads = [_reducescatter_grad(g, ctx) for g in grad_output]
        return (None, None, None, None, None, *grouped_allgather(grads, process_set=ctx.process_set))


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: int = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedReducescatter.apply(
        name, op, process_set, prescale_factor, postscale_factor, *[p[0] for p in pairs]
    )
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


# --------------------------------------------------------------------------- synchronisation
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every member of the set arrives (named operations queued before it are matched first)."""
    ps = resolve(process_set, "barrier")

    def launch(rnd: Round, req: Request) -> Callable[[], Any]:
        work = rnd.comm.barrier(async_op=True)
        return Finish([work], lambda: None)

    key = engine.make_key("barrier", None, ps)
    synchronize(_submit(Request(key, "barrier", [], [], [], launch, ps)))


def join(device: int = -1) -> int:
    """This rank ran out of data: answer the other ranks' allreduces with zeros until every rank has
    joined. Returns the rank that joined last (the same on every rank)."""
    resolve(global_process_set, "join")
    return engine.join()


def poll(handle: int) -> bool:
    """Whether the operation behind `handle` has finished; after True, `synchronize` does not block.

    It never waits: a queued operation progresses when some rank waits (synchronize, a blocking op,
    barrier, join), as its agreement needs every rank.
    """
    return engine.poll(handle)


def synchronize(handle: int) -> Any:
    """Wait for the operation behind `handle` and return its result (raises HorovodInternalError if it failed)."""
    return engine.synchronize(handle)
