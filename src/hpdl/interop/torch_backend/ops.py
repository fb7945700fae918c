"""torch.distributed's collectives in terms of hpdl's `Communicator`.

Each function starts one torch operation on `comm` (hpdl posts its
non-blocking calls) and returns `(parts, finish)`: the hpdl handles in
flight and the step that, once they are done, moves results where torch
expects them (list outputs, non-contiguous tensors). Everything here runs
under the progress lock (see progress.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from hpdl.comm.base import Communicator, is_block_of
from hpdl.comm.work import completed

__all__ = ["reduce_op", "plain_op"]

ALLTOALL_TAG = 32767 - 11
"""Point-to-point tag of uneven all-to-all exchanges (MPI guarantees tags up to 32767)."""

_RED: Any = dist.ReduceOp.RedOpType  # its members are not in torch's stubs
_HPDL_OPS = {_RED.SUM: "sum", _RED.AVG: "avg", _RED.MAX: "max", _RED.MIN: "min", _RED.PRODUCT: "prod"}
_BITWISE = {_RED.BAND: torch.bitwise_and, _RED.BOR: torch.bitwise_or, _RED.BXOR: torch.bitwise_xor}


class Reduction:
    """A torch ReduceOp as hpdl sees it: an hpdl op, a factor to pre-multiply by, or a bitwise op."""

    __slots__ = ("op", "factor", "bitwise")

    def __init__(self, op: str, factor: Optional[float] = None, bitwise: Optional[Callable] = None):
        self.op, self.factor, self.bitwise = op, factor, bitwise


_PLAIN = {kind.value: Reduction(op) for kind, op in _HPDL_OPS.items()}
"""Keyed by the enum's int: pybind enums hash and compare in Python (a lookup by the enum itself cost 0.5 us)."""
_REDUCE_OP: Any = dist.ReduceOp


def reduce_op(value: Any) -> Reduction:
    kind = value.op if type(value) is _REDUCE_OP else value  # a ReduceOp (its type in .op) or a RedOpType
    plain = _PLAIN.get(kind.value)
    if plain is not None:
        return plain
    if kind == _RED.PREMUL_SUM:
        factor = getattr(value, "factor", None)
        if factor is None:
            raise ValueError(
                f"ReduceOp.PREMUL_SUM: torch {torch.__version__} does not show the op's factor to Python (2.13 "
                "does), so the hpdl backend cannot apply it; multiply first and use ReduceOp.SUM, or upgrade torch"
            )
        return Reduction("sum", float(factor.item() if isinstance(factor, torch.Tensor) else factor))
    if kind in _BITWISE:
        return Reduction("sum", bitwise=_BITWISE[kind])
    raise ValueError(f"the hpdl backend does not support ReduceOp {kind}")


def plain_op(value: Any) -> Optional[str]:
    """hpdl's name of a ReduceOp that needs nothing but hpdl's own reduction (SUM, AVG, MAX, MIN, PRODUCT)."""
    kind = value.op if type(value) is _REDUCE_OP else value
    plain = _PLAIN.get(kind.value)
    return plain.op if plain is not None else None


def _contiguous(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A contiguous tensor to hand to hpdl, and the copy back into `t` when it was not contiguous itself."""
    if t.is_contiguous():
        return t, _nothing
    c = t.contiguous()

    def back() -> None:
        t.copy_(c)

    return c, back


def _nothing() -> None:
    return None


def _then(*steps: Callable[[], None]) -> Callable[[], None]:
    def finish() -> None:
        for step in steps:
            step()

    return finish


# ---------------------------------------------------------------------------- reductions
def _allreduce_one(comm: Communicator, t: torch.Tensor, red: Reduction) -> tuple[Any, Callable[[], None]]:
    c, back = _contiguous(t)
    if red.bitwise is not None:
        rows = comm.allgather(c.reshape(1, -1), sizes=[1] * comm.size)
        result = rows[0].clone()
        for row in rows[1:]:
            red.bitwise(result, row, out=result)
        c.copy_(result.view_as(c))
        return completed(comm, "allreduce", -1, c), back
    if red.factor is not None:
        c.mul_(red.factor)
    return comm.allreduce(c, red.op, async_op=True), back


def allreduce(comm: Communicator, tensors: Sequence[torch.Tensor], opts: Any) -> tuple[list, Callable]:
    red = reduce_op(opts.reduceOp)
    parts, backs = [], []
    for t in tensors:
        work, back = _allreduce_one(comm, t, red)
        parts.append(work)
        backs.append(back)
    return parts, _then(*backs)


def allreduce_coalesced(comm: Communicator, tensors: Sequence[torch.Tensor], opts: Any) -> tuple[list, Callable]:
    red = reduce_op(opts.reduceOp)
    if red.bitwise is not None or not all(t.is_contiguous() for t in tensors) or len({t.device for t in tensors}) > 1:
        return allreduce(comm, tensors, opts)
    if red.factor is not None:
        for t in tensors:
            t.mul_(red.factor)
    return [comm.allreduce_coalesced(list(tensors), red.op, async_op=True)], _nothing


def reduce(comm: Communicator, tensors: Sequence[torch.Tensor], opts: Any) -> tuple[list, Callable]:
    red = reduce_op(opts.reduceOp)
    parts, backs = [], []
    for t in tensors:
        if comm.rank == opts.rootRank:
            work, back = _allreduce_one(comm, t, red)
            backs.append(back)
        else:  # non-root inputs stay as they were
            work, _ = _allreduce_one(comm, t.clone(), red)
        parts.append(work)
    return parts, _then(*backs)


def _flat_input(t: torch.Tensor, red: Optional[Reduction] = None) -> torch.Tensor:
    flat = t.contiguous().view(-1) if not t.is_contiguous() else t.view(-1)
    if red is not None and red.factor is not None:
        flat = flat * red.factor  # a new tensor: the caller's input is not changed
    return flat


def _out_buffer(out: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    if out.is_contiguous():
        return out.view(-1), _nothing
    flat = torch.empty(out.numel(), dtype=out.dtype, device=out.device)

    def back() -> None:
        out.copy_(flat.view_as(out))

    return flat, back


def reduce_scatter_single(
    comm: Communicator, output: torch.Tensor, input: torch.Tensor, opts: Any
) -> tuple[list, Callable]:
    red = reduce_op(opts.reduceOp)
    if input.numel() != output.numel() * comm.size:
        raise ValueError(
            f"reduce_scatter_tensor: the input has {input.numel()} elements; it must have world size "
            f"({comm.size}) x the output's {output.numel()}"
        )
    if red.bitwise is not None:
        whole = input.clone()
        work, _ = _allreduce_one(comm, whole, red)
        work.wait()
        output.copy_(whole.view(-1)[comm.rank * output.numel() : (comm.rank + 1) * output.numel()].view_as(output))
        return [], _nothing
    flat_out, back = _out_buffer(output)
    work = comm.reduce_scatter(_flat_input(input, red), red.op, out=flat_out, async_op=True)
    return [work], back


def reduce_scatter(
    comm: Communicator, outputs: Sequence[torch.Tensor], inputs: Sequence[Sequence[torch.Tensor]], opts: Any
) -> tuple[list, Callable]:
    parts, backs = [], []
    for out, chunks in zip(outputs, inputs):
        if len(chunks) != comm.size or any(c.numel() != out.numel() for c in chunks):
            raise ValueError(
                f"reduce_scatter: pass {comm.size} input tensors (one per rank), each with as many elements as "
                f"the output ({out.numel()}); got sizes {[c.numel() for c in chunks]}"
            )
        whole = torch.cat([c.reshape(-1) for c in chunks]) if chunks else out.new_empty(0)
        p, back = reduce_scatter_single(comm, out, whole, opts)
        parts += p
        backs.append(back)
    return parts, _then(*backs)


def reduce_scatter_single_coalesced(
    comm: Communicator, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any
) -> tuple[list, Callable]:
    parts, backs = [], []
    for out, inp in zip(outputs, inputs):
        p, back = reduce_scatter_single(comm, out, inp, opts)
        parts += p
        backs.append(back)
    return parts, _then(*backs)


# ---------------------------------------------------------------------------- gathers
def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.numel() or not b.numel() or a.device != b.device:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + a.numel() * a.element_size()
    b1 = b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


def all_gather_single(
    comm: Communicator, output: torch.Tensor, input: torch.Tensor, opts: Any
) -> tuple[list, Callable]:
    n = input.numel()
    if output.numel() != n * comm.size:
        raise ValueError(
            f"all_gather_into_tensor: the output has {output.numel()} elements; it must have world size "
            f"({comm.size}) x the input's {n}"
        )
    if output.dtype != input.dtype:
        raise ValueError(f"all_gather_into_tensor: output dtype {output.dtype} differs from input's {input.dtype}")
    flat_out, back = _out_buffer(output)
    source = _flat_input(input)
    # The input is often this rank's block of the output (FSDP's in-place gather): hpdl gathers in place then.
    if _overlaps(source, flat_out) and not is_block_of(source, flat_out, comm.rank * n):
        source = source.clone()
    work = comm.allgather(source, sizes=[n] * comm.size, out=flat_out, async_op=True)
    return [work], back


def all_gather_single_coalesced(
    comm: Communicator, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any
) -> tuple[list, Callable]:
    parts, backs = [], []
    for out, inp in zip(outputs, inputs):
        p, back = all_gather_single(comm, out, inp, opts)
        parts += p
        backs.append(back)
    return parts, _then(*backs)


def allgather(
    comm: Communicator, outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor], opts: Any
) -> tuple[list, Callable]:
    parts, backs = [], []
    for outs, inp in zip(outputs, inputs):
        if len(outs) != comm.size:
            raise ValueError(f"all_gather: pass a list of {comm.size} output tensors (one per rank); got {len(outs)}")
        counts = [o.numel() for o in outs]
        if counts[comm.rank] != inp.numel():
            raise ValueError(
                f"all_gather: this rank's output tensor has {counts[comm.rank]} elements, its input {inp.numel()}"
            )
        work = comm.allgather(_flat_input(inp), sizes=counts, async_op=True)
        parts.append(work)
        backs.append(_scatter_into(work, outs, counts))
    return parts, _then(*backs)


def _scatter_into(work: Any, outs: Sequence[torch.Tensor], counts: list[int]) -> Callable[[], None]:
    def finish() -> None:
        flat = work.wait()
        start = 0
        for out, n in zip(outs, counts):
            out.copy_(flat[start : start + n].view_as(out))
            start += n

    return finish


def allgather_coalesced(
    comm: Communicator, outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor], opts: Any
) -> tuple[list, Callable]:
    return allgather(comm, outputs, inputs, opts)


def gather(
    comm: Communicator, outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor], opts: Any
) -> tuple[list, Callable]:
    root = opts.rootRank
    parts, backs = [], []
    for i, inp in enumerate(inputs):
        n = inp.numel()
        work = comm.allgather(_flat_input(inp), sizes=[n] * comm.size, async_op=True)
        parts.append(work)
        if comm.rank == root:
            backs.append(_scatter_into(work, outputs[i], [n] * comm.size))
    return parts, _then(*backs)


def scatter(
    comm: Communicator, outputs: Sequence[torch.Tensor], inputs: Sequence[Sequence[torch.Tensor]], opts: Any
) -> tuple[list, Callable]:
    root = opts.rootRank
    parts, backs = [], []
    for i, out in enumerate(outputs):
        n = out.numel()
        if comm.rank == root:
            whole = torch.cat([c.reshape(-1) for c in inputs[i]]) if n else out.new_empty(0)
        else:
            whole = torch.empty(n * comm.size, dtype=out.dtype, device=out.device)
        parts.append(comm.broadcast(whole, root, async_op=True))
        backs.append(_chunk_into(out, whole, comm.rank))
    return parts, _then(*backs)


def _chunk_into(out: torch.Tensor, whole: torch.Tensor, index: int) -> Callable[[], None]:
    def finish() -> None:
        n = out.numel()
        out.copy_(whole[index * n : (index + 1) * n].view_as(out))

    return finish


# ---------------------------------------------------------------------------- all-to-all
def all_to_all_single(
    comm: Communicator,
    output: torch.Tensor,
    input: torch.Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    opts: Any,
) -> tuple[list, Callable]:
    size = comm.size
    even = not output_splits and not input_splits
    if even:
        if input.numel() != output.numel() or input.numel() % size:
            raise ValueError(
                f"all_to_all_single: input ({input.numel()} elements) and output ({output.numel()}) must be equal "
                f"and divisible by the world size ({size}) when no split sizes are given"
            )
        flat_out, back = _out_buffer(output)
        source = _flat_input(input)
        if _overlaps(source, flat_out):
            source = source.clone()
        return [comm.alltoall(source, out=flat_out, async_op=True)], back
    in_rows = list(input_splits) or [input.shape[0] // size] * size
    out_rows = list(output_splits) or [output.shape[0] // size] * size
    return _exchange(comm, _rows(input, in_rows), _rows(output, out_rows))


def _rows(t: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    if t.dim() == 0:
        raise ValueError("all_to_all_single: split sizes need tensors with at least one dimension")
    if sum(rows) != t.shape[0]:
        raise ValueError(f"all_to_all_single: split sizes {rows} do not add up to dim 0 ({t.shape[0]})")
    return list(torch.split(t, rows, dim=0))


def _exchange(comm: Communicator, sends: list[torch.Tensor], recvs: list[torch.Tensor]) -> tuple[list, Callable]:
    """Uneven all-to-all as point-to-point messages: block j to rank j, block i from rank i."""
    parts, backs = [], []
    me = comm.rank
    for peer in range(comm.size):
        if peer == me:
            recvs[me].copy_(sends[me])
            continue
        if recvs[peer].numel():
            buffer, back = _contiguous(recvs[peer])
            parts.append(comm.recv(buffer, peer, tag=ALLTOALL_TAG, async_op=True))
            backs.append(back)
        if sends[peer].numel():
            parts.append(comm.send(sends[peer].contiguous(), peer, tag=ALLTOALL_TAG, async_op=True))
    return parts, _then(*backs)


def alltoall(
    comm: Communicator, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any
) -> tuple[list, Callable]:
    if len(outputs) != comm.size or len(inputs) != comm.size:
        raise ValueError(f"all_to_all: pass {comm.size} input and {comm.size} output tensors (one per rank)")
    sizes = {t.numel() for t in list(outputs) + list(inputs)}
    dtypes = {t.dtype for t in list(outputs) + list(inputs)}
    if len(sizes) == 1 and len(dtypes) == 1:
        n = sizes.pop()
        whole = torch.cat([t.reshape(-1) for t in inputs]) if n else inputs[0].new_empty(0)
        work = comm.alltoall(whole, async_op=True)
        return [work], _scatter_into(work, outputs, [n] * comm.size)
    return _exchange(comm, list(inputs), list(outputs))


# ---------------------------------------------------------------------------- the rest
def broadcast(comm: Communicator, tensors: Sequence[torch.Tensor], opts: Any) -> tuple[list, Callable]:
    parts, backs = [], []
    for t in tensors:
        c, back = _contiguous(t)
        parts.append(comm.broadcast(c, opts.rootRank, async_op=True))
        backs.append(back)
    return parts, _then(*backs)


def barrier(comm: Communicator, opts: Any) -> tuple[list, Callable]:
    return [comm.barrier(async_op=True)], _nothing


def send(comm: Communicator, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> tuple[list, Callable]:
    return [comm.send(t.contiguous(), dst, tag=tag, async_op=True) for t in tensors], _nothing


def recv(comm: Communicator, tensors: Sequence[torch.Tensor], src: Optional[int], tag: int) -> tuple[list, Callable]:
    parts, backs = [], []
    for t in tensors:
        c, back = _contiguous(t)
        parts.append(comm.recv(c, src, tag=tag, async_op=True))
        backs.append(back)
    return parts, _then(*backs)
