"""hpdl.horovod's collectives against NumPy/torch references, on 2 and 3 MPI ranks and on gloo.

Each body runs a Horovod user's calls on every rank of a shared pool; the
per-rank results come back and are compared here with the same arithmetic
done on the stacked inputs of all ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

POOLS = [("mpi", 2), ("mpi", 3), ("torch", 2)]


def rank_data(r: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + r)
    return torch.randint(-9, 10, shape, generator=g).to(dtype)


def collectives_body(comm):
    import hpdl.horovod as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {}
    for dtype in (torch.int32, torch.float64, torch.float16):
        x = rank_data(r, (4, 3), dtype)
        for op in ("Sum", "Average", "Min", "Max", "Product"):
            out[(str(dtype), op)] = hvd.allreduce(x, op=getattr(hvd, op), name=f"ar.{dtype}.{op}")
        out[(str(dtype), "scaled")] = hvd.allreduce(
            x, op=hvd.Sum, prescale_factor=0.37, postscale_factor=1.9, name=f"scaled.{dtype}"
        )
        y = x.clone()
        hvd.allreduce_(y, op=hvd.Sum, name=f"inplace.{dtype}")
        out[(str(dtype), "inplace")] = y
    g = hvd.grouped_allreduce([rank_data(r, (5,), torch.float64), rank_data(r, (2, 2), torch.int64)], op=hvd.Sum)
    out["grouped"] = g
    out["allgather"] = hvd.allgather(torch.full((r + 1, 2), float(r)))
    out["grouped_allgather"] = hvd.grouped_allgather([torch.full((r + 1,), r), torch.full((1, 3), float(r))])
    out["broadcast"] = hvd.broadcast(torch.tensor([float(r)]), root_rank=n - 1)
    # alltoall: rank r sends j + 1 rows (all equal to 10 r + j) to rank j
    rows = torch.cat([torch.full((j + 1, 2), float(10 * r + j)) for j in range(n)])
    out["alltoall"] = hvd.alltoall(rows, splits=torch.tensor([j + 1 for j in range(n)], dtype=torch.int32))
    out["alltoall_even"] = hvd.alltoall(torch.arange(2 * n) + 100 * r)
    big = rank_data(r, (2 * n + 1, 2), torch.float64)  # uneven: the first rank gets one row more
    out["reducescatter"] = hvd.reducescatter(big, op=hvd.Sum)
    out["grouped_reducescatter"] = hvd.grouped_reducescatter([big, big * 2], op=hvd.Average)
    # async: handles finish in any order; poll never waits
    handles = [hvd.allreduce_async(torch.tensor([float(r + k)]), op=hvd.Sum, name=f"async{k}") for k in range(3)]
    out["polled"] = hvd.poll(handles[0])
    out["async"] = [hvd.synchronize(h) for h in reversed(handles)]
    hvd.barrier()
    return out


@pytest.mark.parametrize(("backend", "nprocs"), POOLS)
def test_collectives_match_references(ranks, backend, nprocs):
    results = ranks(backend, nprocs).run(collectives_body)
    n = nprocs
    for r, out in enumerate(results):
        for dtype in (torch.int32, torch.float64, torch.float16):
            xs = torch.stack([rank_data(k, (4, 3), dtype) for k in range(n)]).double()
            want = {
                "Sum": xs.sum(0),
                "Min": xs.min(0).values,
                "Max": xs.max(0).values,
                "Product": xs.prod(0),
                "Average": xs.sum(0) / n,
            }
            for op, ref in want.items():
                got = out[(str(dtype), op)]
                assert got.dtype == dtype, (dtype, op)
                if dtype == torch.int32 and op == "Average":
                    ref = torch.trunc(ref)  # Horovod: integers are scaled in float64 and truncated
                tol = 1e-2 * float(ref.abs().max()) if dtype == torch.float16 else 1e-9
                assert float((got.double() - ref).abs().max()) <= tol, (dtype, op)
            if dtype == torch.int32:
                scaled = sum(torch.trunc(xs[k] * 0.37) for k in range(n))
                scaled = torch.trunc(scaled * 1.9)
            else:
                scaled = xs.sum(0) * 0.37 * 1.9
            tol = 5e-2 if dtype == torch.float16 else 1e-9
            assert float((out[(str(dtype), "scaled")].double() - scaled).abs().max()) <= tol
            assert float((out[(str(dtype), "inplace")].double() - xs.sum(0)).abs().max()) <= tol
        g0 = sum(rank_data(k, (5,), torch.float64) for k in range(n))
        g1 = sum(rank_data(k, (2, 2), torch.int64) for k in range(n))
        assert torch.equal(out["grouped"][0], g0) and torch.equal(out["grouped"][1], g1)
        assert torch.equal(out["allgather"], torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)]))
        ga = out["grouped_allgather"]
        assert torch.equal(ga[0], torch.cat([torch.full((k + 1,), k) for k in range(n)]))
        assert torch.equal(ga[1], torch.cat([torch.full((1, 3), float(k)) for k in range(n)]))
        assert torch.equal(out["broadcast"], torch.tensor([float(n - 1)]))
        received, splits = out["alltoall"]
        assert splits.tolist() == [r + 1] * n and splits.dtype == torch.int32
        assert torch.equal(received, torch.cat([torch.full((r + 1, 2), float(10 * k + r)) for k in range(n)]))
        assert torch.equal(
            out["alltoall_even"], torch.tensor([100 * k + 2 * r + i for k in range(n) for i in range(2)])
        )
        total = sum(rank_data(k, (2 * n + 1, 2), torch.float64) for k in range(n))
        counts = [(2 * n + 1) // n + (1 if k < (2 * n + 1) % n else 0) for k in range(n)]
        start = sum(counts[:r])
        mine = total[start : start + counts[r]]
        assert torch.allclose(out["reducescatter"], mine, atol=1e-12)
        gr = out["grouped_reducescatter"]
        assert torch.allclose(gr[0], mine / n, atol=1e-12) and torch.allclose(gr[1], 2 * mine / n, atol=1e-12)
        assert out["polled"] is False
        assert [float(t) for t in out["async"]] == [float(sum(k + j for k in range(n))) for j in (2, 1, 0)]


def autograd_body(comm):
    import hpdl.horovod as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    grads = {}
    x = torch.arange(3, dtype=torch.float64, requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * (r + 1)).sum().backward()
    grads["allreduce"] = x.grad.clone()
    x = torch.ones(r + 1, 2, dtype=torch.float64, requires_grad=True)
    weights = torch.arange(sum(k + 1 for k in range(n)) * 2, dtype=torch.float64).view(-1, 2)
    (hvd.allgather(x) * weights).sum().backward()
    grads["allgather"] = x.grad.clone()
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    (hvd.broadcast(x, root_rank=0) * (r + 1)).sum().backward()
    grads["broadcast"] = x.grad.clone()
    x = torch.ones(2 * n, dtype=torch.float64, requires_grad=True)
    (hvd.reducescatter(x, op=hvd.Sum) * (r + 1)).sum().backward()
    grads["reducescatter"] = x.grad.clone()
    x = torch.ones(n, dtype=torch.float64, requires_grad=True)
    out = hvd.alltoall(x)
    (out * (r + 1)).sum().backward()
    grads["alltoall"] = x.grad.clone()
    return grads


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a.double(), b.double(), atol=1e-12)


@pytest.mark.parametrize(("backend", "nprocs"), [("mpi", 2), ("mpi", 3)])
def test_gradients_are_horovods(ranks, backend, nprocs):
    n = nprocs
    results = ranks(backend, nprocs).run(autograd_body)
    mean_weight = sum(k + 1 for k in range(n)) / n
    weights = torch.arange(sum(k + 1 for k in range(n)) * 2, dtype=torch.float64).view(-1, 2)
    for r, g in enumerate(results):
        # allreduce(Sum)'s gradient is allreduce(Sum) of the incoming gradients
        assert close(g["allreduce"], torch.full((3,), float(sum(k + 1 for k in range(n)))))
        # allgather: the averaged incoming gradient's rows that belong to this rank
        start = sum(k + 1 for k in range(r))
        assert close(g["allgather"], weights[start : start + r + 1])
        # broadcast: the averaged gradient on the root, zeros elsewhere
        assert close(g["broadcast"], torch.full((2,), mean_weight if r == 0 else 0.0))
        # reducescatter(Sum): allgather of the (size-scaled) gradients
        assert close(g["reducescatter"], torch.tensor([float(k // 2 + 1) * n for k in range(2 * n)]))
        # alltoall: element j went to rank j, whose weight is j + 1
        assert close(g["alltoall"], torch.tensor([float(j + 1) for j in range(n)]))


def adasum_body(comm):
    import hpdl.horovod as hvd

    hvd.init()
    r = hvd.rank()
    g = torch.Generator().manual_seed(7 + r)
    a = torch.randn(6, generator=g, dtype=torch.float64)
    b = torch.randn(2, 2, generator=g, dtype=torch.float64)
    single = hvd.allreduce(a, op=hvd.Adasum)
    grouped = hvd.grouped_allreduce([a, b], op=hvd.Adasum)
    return a, b, single, grouped


def numpy_adasum(vectors):
    level = [np.asarray(v, dtype=np.float64).ravel() for v in vectors]
    while len(level) > 1:
        nxt = []
        for x, y in zip(level[0::2], level[1::2]):
            dot = x @ y
            nxt.append((1 - dot / (2 * (x @ x))) * x + (1 - dot / (2 * (y @ y))) * y)
        level = nxt
    return level[0]


def test_adasum_is_the_real_reduction(ranks):
    results = ranks("mpi", 2).run(adasum_body)
    want_a = numpy_adasum([res[0].numpy() for res in results])
    want_b = numpy_adasum([res[1].numpy() for res in results])
    for _, _, single, grouped in results:
        assert np.allclose(single.numpy(), want_a, atol=1e-12)
        assert np.allclose(grouped[0].numpy(), want_a, atol=1e-12)
        assert np.allclose(grouped[1].numpy().ravel(), want_b, atol=1e-12)
    # orthogonal gradients add, identical ones average
    assert np.allclose(numpy_adasum([[1.0, 0.0], [0.0, 1.0]]), [1.0, 1.0])
    assert np.allclose(numpy_adasum([[1.0, 2.0], [1.0, 2.0]]), [1.0, 2.0])
