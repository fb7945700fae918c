"""`hpdl bench gpu` (`make gpu-check`): the GPU paths in one short run, for a borrowed GPU machine.

Prints one table (see ../shared/GPU.md):
- `hpdl info` as the machine sees it (NCCL, CUDA-awareness of the MPI library);
- every collective on CUDA tensors over the `mpi` backend (2 ranks: the
  CUDA-aware or the staged path) and over the `torch` backend (NCCL on one
  rank), each checked against the same collective on CPU tensors;
- one training step of the demo model on the GPU with and without
  DataParallel (the wrapper's overhead);
- the "hpdl" torch.distributed backend on CUDA tensors (2 ranks): its
  collectives against CPU tensors, one DDP step and one FSDP2 step;
- hpdl beside NCCL in one torch group ("cpu:hpdl,cuda:nccl", torch >= 2.14;
  one rank, since NCCL needs a GPU per rank): CPU tensors through hpdl,
  CUDA tensors through NCCL;
- one Keras 3 step (torch backend) on GPU tensors with hpdl.keras'
  DistributedOptimizer on 2 ranks, each half the batch, the gradients
  staged through hpdl's collectives, against one process on the whole
  batch: same weights, and both times (skipped, as n/a, on the CPU dry
  run: Keras' start-up is seconds per rank and the CPU path is tested in
  tests/test_keras.py);
- hpdl.ml's K-Means and k-NN on device arrays (CuPy when it is installed,
  else torch CUDA tensors) against the same fit on NumPy: same answers,
  and the speed-up.

`--device cpu` runs the same checks on the CPU, which is how CI keeps this
script working on machines without a GPU. One GPU cannot show multi-GPU
scaling; the table says what ran where.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Optional

from hpdl.runtime import spawn

__all__ = ["launch", "main"]

OPS = ("allreduce", "allgather", "reduce_scatter", "reduce_scatter 8 MiB", "broadcast", "alltoall", "sendrecv")
"""("reduce_scatter 8 MiB": a block each way above the size from which the mpi backend leaves a CUDA tensor to a
CUDA-aware MPI's collective instead of messages staged through the host, mpi_general.DEVICE_PAIR_BELOW)"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpdl bench gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the checks run")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for each job")
    parser.add_argument("--worker", choices=("mpi", "torch", "beside"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser


NO_CUDA = "hpdl bench gpu: no CUDA device here; use --device cpu for a dry run"


def launch(argv: list[str]) -> int:
    """Run the checks (two short jobs) and print the table; non-zero when a check fails."""
    try:
        options = build_parser().parse_args(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 0
    if options.device == "cuda":
        import torch

        if not torch.cuda.is_available():  # at once, not from every rank of three jobs
            print(NO_CUDA, file=sys.stderr)
            return 1
    from hpdl.cli.info import collect

    info = collect()
    rows: list[list[str]] = [["hpdl info", "-", json.dumps({k: info[k] for k in ("torch", "cuda")}, default=str)]]
    rows.append(["hpdl info", "-", f"mpi library {info.get('mpi library')}, cuda-aware {info.get('mpi cuda-aware')}"])
    # (on the first GPU machine the compiled calls had fallen back to mpi4py, which only this line showed)
    rows.append(["hpdl info", "mpi fast-path calls", str(info.get("mpi fast-path calls"))])
    failed = False
    with tempfile.TemporaryDirectory() as folder:
        for backend, worker, ranks in (("mpi", "mpi", 2), ("torch", "torch", 1), ("mpi", "beside", 1)):
            out = os.path.join(folder, f"{worker}.json")
            target = ["-m", "hpdl.bench.gpu_check", "--worker", worker, "--device", options.device, "--out", out]
            code = spawn.run(ranks, target, backend=backend, timeout=options.timeout, name="hpdl bench gpu")
            if code != 0 or not os.path.exists(out):
                rows.append([backend, "job", f"FAIL (exit code {code})"])
                failed = True
                continue
            for name, verdict, detail in json.load(open(out)):
                rows.append([backend, name, f"{verdict} {detail}".strip()])
                failed |= verdict == "FAIL"
    from hpdl.bench import report

    print(report.markdown_table(["backend", "check", "result"], rows))
    return 1 if failed else 0


def _device(choice: str) -> Any:
    import torch

    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit(NO_CUDA)
    return torch.device(choice)


def collectives(comm: Any, device: Any) -> list[tuple[str, str, str]]:
    """Every collective on `device` tensors against the same call on CPU tensors (identical results)."""
    import torch

    results = []
    k, r = comm.size, comm.rank
    for op in OPS:
        if op == "sendrecv" and k < 2:
            continue
        started = time.perf_counter()
        try:
            outputs, seconds = [], []
            for where in (torch.device("cpu"), device):
                row = 2 << 20 if op == "reduce_scatter 8 MiB" else 1024
                x = (torch.arange(k * row, dtype=torch.float32, device=where) + r).reshape(k, row)
                comm.barrier()
                began = time.perf_counter()
                if op == "allreduce":
                    outputs.append(comm.allreduce(x.clone(), op="avg"))
                elif op == "allgather":
                    outputs.append(comm.allgather(x[: r + 1].contiguous()))
                elif op.startswith("reduce_scatter"):
                    outputs.append(comm.reduce_scatter(x))
                elif op == "broadcast":
                    outputs.append(comm.broadcast(x.clone(), root=k - 1))
                elif op == "alltoall":
                    outputs.append(comm.alltoall(x))
                else:
                    y = torch.empty_like(x)
                    sending = comm.send(x, (r + 1) % k, async_op=True)
                    comm.recv(y, (r - 1) % k)
                    sending.wait()
                    outputs.append(y)
                if where.type == "cuda":
                    torch.cuda.synchronize(where)
                seconds.append(time.perf_counter() - began)
            on_cpu, on_device = outputs
            same = on_device.device.type == device.type and torch.equal(on_device.cpu(), on_cpu)
            elapsed = (time.perf_counter() - started) * 1e3
            calls = f"the call {seconds[0] * 1e3:.2f} ms on cpu, {seconds[1] * 1e3:.2f} ms on {on_device.device}"
            results.append((op, "PASS" if same else "FAIL", f"{on_device.device}, {elapsed:.1f} ms for both ({calls})"))
        except Exception as exc:  # report every op, do not stop at the first
            results.append((op, "FAIL", f"{type(exc).__name__}: {exc}"[:200]))
    return results


def training_step(comm: Any, device: Any) -> list[tuple[str, str, str]]:
    """One step of the demo model with and without DataParallel: same loss, and the wrapper's cost."""
    import torch
    import torch.nn.functional as F

    from hpdl.parallel import DataParallel
    from hpdl.train.demo import build_model

    torch.manual_seed(0)
    x, y = torch.randn(64, 1, 8, 8, device=device), torch.randint(0, 10, (64,), device=device)
    timings, losses = {}, {}
    for name in ("plain", "DataParallel"):
        torch.manual_seed(0)
        model = build_model().to(device)
        if name == "DataParallel":
            model = DataParallel(model, comm)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = []
        for _ in range(6):
            started = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            steps.append(time.perf_counter() - started)
        timings[name] = sorted(steps[1:])[len(steps[1:]) // 2] * 1e3
        losses[name] = float(loss.detach())
    agree = abs(losses["plain"] - losses["DataParallel"]) < 1e-4
    detail = f"plain {timings['plain']:.2f} ms, DataParallel {timings['DataParallel']:.2f} ms per step"
    return [("training step", "PASS" if agree else "FAIL", detail)]


def keras_step(comm: Any, device: Any) -> list[tuple[str, str, str]]:
    """One Keras step on `device`: hpdl.keras on the ranks (half the batch each) against one process."""
    if device.type != "cuda":
        return [("keras step", "n/a", "needs a CUDA device (--device cuda); the CPU path: tests/test_keras.py")]
    if "keras" not in sys.modules:
        os.environ.setdefault("KERAS_BACKEND", "torch")
    try:
        import keras
    except ImportError:
        return [("keras step", "n/a", "keras is not installed (pip install hpdl[tensorflow])")]
    if keras.backend.backend() != "torch":
        return [("keras step", "n/a", f"KERAS_BACKEND={keras.backend.backend()}; the GPU row runs on torch")]
    import numpy as np
    import torch

    import hpdl.keras as hvd

    hvd.init()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(256, 64)).astype("float32"), rng.integers(0, 10, 256)
    init = None
    weights, times = {}, {}
    for name in ("one process", "hpdl.keras"):
        model = keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(512, activation="relu"), keras.layers.Dense(10)]
        )
        init = init or [np.asarray(w) for w in model.get_weights()]
        model.set_weights(init)
        optimizer = keras.optimizers.SGD(0.1)
        xs, ys = x, y
        if name == "hpdl.keras":
            optimizer = hvd.DistributedOptimizer(optimizer)
            xs, ys = x[comm.rank :: comm.size], y[comm.rank :: comm.size]
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        steps = []
        for _ in range(6):
            model.set_weights(init)
            started = time.perf_counter()
            model.train_on_batch(xs, ys)
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - started)
        on_gpu = model.trainable_variables[0].value.device.type == "cuda"
        weights[name] = [np.asarray(w) for w in model.get_weights()]
        times[name] = (sorted(steps[1:])[len(steps[1:]) // 2] * 1e3, on_gpu)
    error = max(float(np.abs(a - b).max()) for a, b in zip(weights["one process"], weights["hpdl.keras"]))
    ok = error < 1e-5 and all(g for _, g in times.values())
    detail = (f"one process {times['one process'][0]:.2f} ms, hpdl.keras on {comm.size} ranks "
              f"{times['hpdl.keras'][0]:.2f} ms per step; weights differ by {error:.1e}")  # fmt: skip
    return [("keras step", "PASS" if ok else "FAIL", detail)]


def torch_backend(device: Any) -> list[tuple[str, str, str]]:
    """The "hpdl" torch.distributed backend on `device` tensors: collectives against CPU tensors, and a DDP step."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hpdl.train.demo import build_model

    results = []
    if not dist.is_initialized():
        dist.init_process_group("hpdl")
    k, r = dist.get_world_size(), dist.get_rank()
    calls = {
        "all_reduce": lambda x: (dist.all_reduce(x), x)[1],
        "all_gather_into_tensor": lambda x: (dist.all_gather_into_tensor(out := x.new_empty(k * x.numel()), x), out)[1],
        "reduce_scatter_tensor": lambda x: (dist.reduce_scatter_tensor(out := x.new_empty(x.numel() // k), x), out)[1],
        "broadcast": lambda x: (dist.broadcast(x, src=k - 1), x)[1],
        "all_to_all_single": lambda x: (dist.all_to_all_single(out := torch.empty_like(x), x), out)[1],
    }
    for name, call in calls.items():
        try:
            cpu, dev = (call(torch.arange(k * 256, dtype=torch.float32, device=w) + r) for w in ("cpu", device))
            same = dev.device.type == device.type and torch.equal(dev.cpu(), cpu)
            results.append((f"backend {name}", "PASS" if same else "FAIL", str(dev.device)))
        except Exception as exc:
            results.append((f"backend {name}", "FAIL", f"{type(exc).__name__}: {exc}"[:200]))
    try:
        torch.manual_seed(0)
        plain = build_model().to(device)
        torch.manual_seed(0)
        model = DDP(build_model().to(device))
        x, y = torch.randn(64, 1, 8, 8, device=device), torch.randint(0, 10, (64,), device=device)
        F.cross_entropy(model(x), y).backward()  # every rank the same batch: DDP's mean is the local gradient
        F.cross_entropy(plain(x), y).backward()
        diff = max(float((a.grad - b.grad).abs().max()) for a, b in zip(model.parameters(), plain.parameters()))
        results.append(("backend DDP step", "PASS" if diff < 1e-5 else "FAIL", f"{device}, grad diff {diff:.1e}"))
    except Exception as exc:
        results.append(("backend DDP step", "FAIL", f"{type(exc).__name__}: {exc}"[:200]))
    results.append(_fsdp2_step(device))
    dist.destroy_process_group()
    return results


def beside_another_backend(device: Any) -> list[tuple[str, str, str]]:
    """hpdl beside another backend in one torch group (torch >= 2.14, `HpdlBackend`): a CPU tensor's all_reduce is
    one hpdl call, a CUDA tensor's goes to NCCL (gloo on the CPU dry run, which has no CUDA tensor to send)."""
    import torch
    import torch.distributed as dist

    from hpdl.interop.torch_backend.process_group import python_backends

    name = "backend beside another"
    if not python_backends():
        return [(name, "n/a", f"torch {torch.__version__}: a Python backend sits beside another from torch 2.14")]
    spec = "cpu:hpdl,cuda:" + ("nccl" if device.type == "cuda" else "gloo")
    try:
        dist.init_process_group(spec)
        group: Any = dist.group.WORLD
        hpdl_side = group._get_backend(torch.device("cpu"))  # (an HpdlBackend)
        before = hpdl_side.comm._seq
        on_cpu = torch.arange(4.0)
        dist.all_reduce(on_cpu)
        same = torch.equal(on_cpu, torch.arange(4.0) * dist.get_world_size()) and hpdl_side.comm._seq == before + 1
        detail = f"{spec}: cpu {type(hpdl_side).__name__}"
        if device.type == "cuda":
            on_device = torch.arange(4.0, device=device)
            dist.all_reduce(on_device)
            other = group._get_backend(device).name()
            same &= torch.equal(on_device.cpu(), on_cpu) and hpdl_side.comm._seq == before + 1  # not through hpdl
            detail += f", {device} {other}"
        dist.destroy_process_group()
        return [(name, "PASS" if same else "FAIL", detail)]
    except Exception as exc:
        return [(name, "FAIL", f"{spec}: {type(exc).__name__}: {exc}"[:200])]


def _fsdp2_step(device: Any) -> tuple[str, str, str]:
    """One FSDP2 step over the "hpdl" group (its all-gathers and reduce-scatters on `device` tensors) against the
    same step of the plain model; every rank the same batch, so the sharded gradient is the local one. NCCL beside
    it needs one GPU per rank, which a one-GPU machine does not have."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hpdl.train.demo import build_model

    try:
        torch.manual_seed(0)
        plain = build_model().to(device)
        torch.manual_seed(0)
        model = build_model().to(device)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        fully_shard(model, mesh=mesh)
        x, y = torch.randn(64, 1, 8, 8, device=device), torch.randint(0, 10, (64,), device=device)
        started = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = (time.perf_counter() - started) * 1e3
        F.cross_entropy(plain(x), y).backward()
        diff = max(
            float((a.grad.full_tensor() - b.grad).abs().max()) for a, b in zip(model.parameters(), plain.parameters())
        )
        detail = f"{device}, grad diff {diff:.1e}, {elapsed:.1f} ms (first step)"
        return "backend FSDP2 step", "PASS" if diff < 1e-5 else "FAIL", detail
    except Exception as exc:
        return "backend FSDP2 step", "FAIL", f"{type(exc).__name__}: {exc}"[:200]


def ml_on_device(device: Any) -> list[tuple[str, str, str]]:
    """K-Means and k-NN on device arrays against NumPy: the same centres and neighbours, and the speed-up.

    CUDA: CuPy arrays when CuPy is installed (the DLPack path), else torch
    tensors; 1M x 32 float32 rows. `--device cpu`: torch CPU tensors (the
    same device code) on 20k rows, for CI.
    """
    import numpy as np
    import torch

    from hpdl.ml import KMeans, NearestNeighbors

    big = device.type == "cuda"
    rows, index_rows, queries = (1_000_000, 100_000, 10_000) if big else (20_000, 5_000, 500)
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(16, 32)) * 3
    X = (centres[rng.integers(0, 16, rows)] + rng.normal(size=(rows, 32))).astype(np.float32)
    index, Q = X[:index_rows], X[index_rows : index_rows + queries]
    to_device, kind = _device_arrays(device)

    def sync() -> None:
        if big:
            torch.cuda.synchronize()

    def timed(fit: Any) -> tuple[Any, float]:
        fit()  # warm-up: compilation, the device's first allocations
        sync()
        started = time.perf_counter()
        out = fit()
        sync()
        return out, time.perf_counter() - started

    results = []
    try:
        start = X[:16].copy()

        def kmeans(data: Any) -> Any:
            return KMeans(16, init=start, n_init=1, max_iter=20, tol=0.0).fit(data)

        # The answers compared in float64: in float32, rows at a near-tie go to either centre depending on the
        # order of the sums, and over 20 iterations the centres drift apart by ~1e-3 (both are right).
        X64 = X.astype(np.float64)
        exact_host, exact_dev = kmeans(X64), kmeans(to_device(X64))
        drift = float(np.abs(exact_dev.cluster_centers_ - exact_host.cluster_centers_).max())
        same = drift <= 1e-6 and abs(exact_dev.inertia_ - exact_host.inertia_) <= 1e-9 * exact_host.inertia_
        _, host_s = timed(lambda: kmeans(X))
        Xd = to_device(X)
        _, dev_s = timed(lambda: kmeans(Xd))
        detail = (
            f"{kind}, {rows} x 32 float32: {host_s * 1e3:.0f} ms NumPy, {dev_s * 1e3:.0f} ms device, "
            f"{host_s / dev_s:.1f}x; float64 centres within {drift:.1e}"
        )
        results.append(("ml K-Means", "PASS" if same else "FAIL", detail))
    except Exception as exc:
        results.append(("ml K-Means", "FAIL", f"{type(exc).__name__}: {exc}"[:200]))
    try:
        (_, idx_host), host_s = timed(lambda: NearestNeighbors(n_neighbors=10).fit(index).kneighbors(Q))
        Id, Qd = to_device(index), to_device(Q)
        (_, idx_dev), dev_s = timed(lambda: NearestNeighbors(n_neighbors=10).fit(Id).kneighbors(Qd))
        found = np.asarray(torch.as_tensor(idx_dev, device="cpu")) if not isinstance(idx_dev, np.ndarray) else idx_dev
        recall = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(found.tolist(), idx_host.tolist())]))
        detail = (
            f"{kind}, {index_rows} x {queries} x 32, k=10: {host_s * 1e3:.0f} ms NumPy, {dev_s * 1e3:.0f} ms device, "
            f"{host_s / dev_s:.1f}x; recall against NumPy {recall:.4f}"
        )
        results.append(("ml k-NN", "PASS" if recall >= 0.999 else "FAIL", detail))
    except Exception as exc:
        results.append(("ml k-NN", "FAIL", f"{type(exc).__name__}: {exc}"[:200]))
    return results


def _device_arrays(device: Any) -> tuple[Any, str]:
    """How to put a NumPy array on `device`: CuPy on a GPU where it is installed, else a torch tensor."""
    import torch

    if device.type == "cuda":
        try:
            import cupy

            return cupy.asarray, "CuPy"
        except ImportError:
            pass
    return (lambda a: torch.from_numpy(a).to(device)), f"torch {device.type} tensors"


def main(argv: Optional[list[str]] = None) -> int:
    options = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if not options.worker:
        return launch(sys.argv[1:] if argv is None else argv)
    import hpdl

    if options.worker == "beside":
        results = beside_another_backend(_device(options.device))
        with open(options.out, "w") as handle:
            json.dump(results, handle)
        hpdl.finalize()
        return 0
    comm = hpdl.init(options.worker, timeout=120.0)
    device = _device(options.device)
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(comm.local_rank % torch.cuda.device_count())
    results = collectives(comm, device)
    if comm.size == 1 or options.worker == "mpi":
        results += training_step(comm, device)
    if options.worker == "mpi":
        from hpdl.interop.torch_backend.factory import unavailable

        why = unavailable()  # not a failure of this machine: the torch installed is older than the backend's
        results += [("backend", "n/a", why)] if why else torch_backend(device)
        results += keras_step(comm, device)
    else:
        results += ml_on_device(device)
    if comm.rank == 0:
        with open(options.out, "w") as handle:
            json.dump(results, handle)
    hpdl.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
