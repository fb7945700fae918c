"""Tensor fusion packing, and timelines gathered from every rank into one trace file."""

from __future__ import annotations

import json

import pytest
import torch

from hpdl.comm import fusion
from hpdl.comm.trace import Tracer


def test_pack_groups_by_dtype_and_bounds_bucket_bytes():
    tensors = [torch.ones(100), torch.ones(100, dtype=torch.float64), torch.ones(10, 10), torch.ones(1000)]
    buckets = fusion.pack(tensors, limit_bytes=800)
    kinds = [(b.flat.dtype, b.flat.numel()) for b in buckets]
    # float32: 100 + 100 elements fit 800 bytes; the 1000-element tensor exceeds it and travels alone (no copy)
    assert kinds == [(torch.float32, 200), (torch.float32, 1000), (torch.float64, 100)]
    assert buckets[1].flat.data_ptr() == tensors[3].data_ptr()
    for bucket in buckets:
        bucket.fill()
        bucket.flat.mul_(3)
        bucket.unpack()
    assert all(bool((t == 3).all()) for t in tensors)


def filled(packer, tensors, limit=1 << 20):
    plan = packer.acquire(tensors, limit)
    for bucket in plan.buckets:
        bucket.fill()
    plan.busy = True  # in flight until unpacked, as allreduce_coalesced marks it
    return plan


def test_packer_reuses_a_layout_only_for_the_same_tensors():
    packer = fusion.Packer()
    grads = [torch.full((5,), float(i)) for i in range(4)]
    first = filled(packer, grads)
    assert first.buckets[0].flat.tolist() == [float(i) for i in range(4) for _ in range(5)]
    assert filled(packer, grads) is not first  # still in flight: a fresh layout, never shared
    first.busy = False
    for g in grads:
        g.add_(10)
    again = filled(packer, grads)
    assert again is first and again.buckets[0].flat[0].item() == 10.0  # same layout, current values
    again.busy = False
    grads[0].resize_(3)  # same address, other size: must not reuse
    assert filled(packer, grads) is not first
    other = [torch.ones(5) for _ in range(4)]
    assert filled(packer, other) is not first


def test_packer_finds_the_last_plan_again_only_for_the_same_unchanged_tensor_objects():
    packer = fusion.Packer()
    grads = [torch.full((5,), float(i)) for i in range(4)]
    assert packer.again(grads, 1 << 20) is None  # nothing planned yet
    plan = filled(packer, grads)
    assert packer.again(grads, 1 << 20) is None  # in flight
    plan.busy = False
    assert packer.again(grads, 1 << 20) is plan and packer.again(tuple(grads), 1 << 20) is plan
    assert packer.again(grads, 1 << 19) is None  # another bucket size
    assert packer.again(grads[:3], 1 << 20) is None
    assert packer.again(iter(grads), 1 << 20) is None  # (an iterator is not consumed by the look)
    same_memory = [g.view(-1) for g in grads]  # other objects: the full lookup, which adopts them
    assert packer.again(same_memory, 1 << 20) is None
    assert packer.acquire(same_memory, 1 << 20) is plan and packer.again(same_memory, 1 << 20) is plan
    same_memory[1].resize_(2)  # the same object, shrunk in place at the same address
    assert packer.again(same_memory, 1 << 20) is None
    same_memory[1].resize_(5)
    same_memory[0].data = same_memory[0].data.view(torch.int32)  # the same object, address and size: another dtype
    assert packer.again(same_memory, 1 << 20) is None
    same_memory[0].data = same_memory[0].data.view(torch.float32)
    assert packer.again(same_memory, 1 << 20) is plan
    same_memory[2].set_(torch.zeros(5))  # the same object on other memory
    assert packer.again(same_memory, 1 << 20) is None
    assert packer.acquire(same_memory, 1 << 20) is not plan


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        fusion.bucket_bytes(0)


def traced(comm, path):
    comm.tracer = Tracer()
    with comm.tracer.span("forward", step=1):
        comm.allreduce(torch.ones(1000))
    comm.allgather(torch.ones(3), async_op=True).wait()
    written = comm.tracer.write(path, comm)
    comm.tracer = None
    return written


@pytest.mark.parametrize("backend,nprocs", [("self", 1), ("mpi", 2), ("torch", 2)])
def test_timeline_has_every_rank_and_every_collective(ranks, tmp_path, backend, nprocs):
    path = str(tmp_path / "trace.json")
    written = ranks(backend, nprocs).run(traced, path)
    assert written[0] == path and all(w is None for w in written[1:])
    events = json.load(open(path))["traceEvents"]
    for rank in range(nprocs):
        names = {e["name"] for e in events if e.get("pid") == rank and e["ph"] == "X"}
        assert {"forward", "allreduce", "allgather"} <= names, (rank, names)
    forward = next(e for e in events if e["name"] == "forward")
    inner = next(e for e in events if e["name"] == "allreduce" and e["pid"] == forward["pid"])
    assert forward["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= forward["ts"] + forward["dur"] + 1
