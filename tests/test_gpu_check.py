"""The GPU check script runs end to end; on a machine without a GPU it runs its checks on the CPU (dry run)."""

from __future__ import annotations

import torch

from hpdl.bench.gpu_check import OPS, launch
from hpdl.interop.torch_backend.process_group import python_backends


def rows(table: str) -> dict[tuple[str, str], str]:
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines() if "|" in line]
    return {(c[0], c[1]): c[2] for c in cells if len(c) == 3}


def test_gpu_check_dry_run_on_cpu(capsys):
    assert launch(["--device", "cpu", "--timeout", "120"]) == 0
    results = rows(capsys.readouterr().out)
    assert results[("hpdl info", "mpi fast-path calls")] == "compiled (hpdl.comm._mpi_fast)", results
    for op in OPS:
        assert results[("mpi", op)].startswith("PASS cpu"), results
    for op in ("allreduce", "allgather", "reduce_scatter", "broadcast", "alltoall", "training step"):
        assert results[("torch", op)].startswith("PASS"), results
    assert results[("mpi", "training step")].startswith("PASS plain")
    for check in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single"):
        assert results[("mpi", f"backend {check}")].startswith("PASS cpu"), results
    assert results[("mpi", "backend DDP step")].startswith("PASS"), results
    assert results[("mpi", "backend FSDP2 step")].startswith("PASS cpu"), results
    beside = results[("mpi", "backend beside another")]  # (torch >= 2.14: hpdl's CPU side of "cpu:hpdl,cuda:gloo")
    assert beside.startswith("PASS cpu:hpdl,cuda:gloo: cpu HpdlBackend" if python_backends() else "n/a torch"), beside
    for check in ("ml K-Means", "ml k-NN"):
        assert results[("torch", check)].startswith("PASS torch cpu tensors"), results


def test_gpu_check_refuses_cuda_without_a_gpu_or_passes_with_one(capsys):
    assert launch(["--device", "cuda", "--timeout", "120"]) == (0 if torch.cuda.is_available() else 1)
    if not torch.cuda.is_available():
        assert "no CUDA device here; use --device cpu for a dry run" in capsys.readouterr().err
