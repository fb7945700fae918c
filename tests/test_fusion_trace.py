"""Tensor fusion packing, and timelines gathered from every rank into one trace file."""

from __future__ import annotations

import json

import pytest
import torch

from hpdl.comm import fusion
from hpdl.comm.trace import Tracer


def test_pack_groups_by_dtype_and_bounds_bucket_bytes():
    tensors = [torch.ones(100), torch.ones(100, dtype=torch.float64), torch.ones(100), torch.ones(1000)]
    buckets = fusion.pack(tensors, limit_bytes=800)
    kinds = [(b.flat.dtype, b.flat.numel()) for b in buckets]
    # float32: 100 + 100 elements fit 800 bytes; the 1000-element tensor exceeds it and travels alone (no copy)
    assert kinds == [(torch.float32, 200), (torch.float32, 1000), (torch.float64, 100)]
    assert buckets[1].flat.data_ptr() == tensors[3].data_ptr()
    for bucket in buckets:
        bucket.flat.mul_(3)
        bucket.unpack()
    assert all(bool((t == 3).all()) for t in tensors)


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
