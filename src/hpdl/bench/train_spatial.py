"""`hpdl bench train --strategy spatial`: a ResNet-style CNN on one high-resolution image, 2 ranks, in one launch.

Contenders, alternating per round on the same ranks, the same model, image
and optimizer (SGD with momentum), batch 1:

    single      rank 0 alone runs the whole model on the whole image (the other rank idles)
    spatial     hpdl.parallel.spatial.SpatialParallel: each rank a slab of every activation (halo exchange)
    pipeline    hpdl.parallel.Pipeline, 2 stages (layer parallelism; one image = one micro-batch)

Per contender: samples/s (median, min-max over rounds) and peak activation
bytes per rank (what autograd saved for backward at its peak in one step,
`hpdl.parallel.pipe.memory.ActivationMeter`, the same meter for all). The
spatial run also reports the halo exchange: seconds per step spent
waiting with overlap, and without (the interior computed after the halos
arrived): hidden fraction = 1 - wait(overlap) / wait(no overlap), clamped
to [0, 1] (a noisy machine can make the overlapped steps wait longer).

PyTorch's private `torch.distributed.tensor._tp_conv` (a width split
through DTensor) is probed on one convolution against one process: the
largest error of its output, input gradient and weight gradient is
reported (it is not trained: see docs/spatial.md).

Run it with `hpdl bench train --strategy spatial [--size 1024] [--quick]`.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Optional

from hpdl.bench import report
from hpdl.bench import strategy_harness as harness
from hpdl.bench.arguments import positive
from hpdl.bench.strategy_harness import Options, Ranks

__all__ = ["launch", "main", "CONTENDERS"]

CONTENDERS = ("single", "spatial", "pipeline")
TARGET_VS_PIPELINE = 1.5
TARGET_MEMORY = 0.6
TARGET_HIDDEN = 0.5
LR = 0.01


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=positive(int), default=1024, help="image height = width (default 1024)")
    parser.add_argument("--width", type=positive(int), default=8, help="channels of the first stage (default 8)")


def _check(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    if ns.ranks != 2:
        parser.error(f"-n {ns.ranks}: this benchmark compares 2-way spatial with 2-way pipeline: use -n 2")
    return {"size": 128 if ns.quick and ns.size == 1024 else ns.size, "width": ns.width}


BENCH = harness.Bench(
    strategy="spatial",
    module="hpdl.bench.train_spatial",
    description="Samples/s and activation memory per rank of a ResNet-style CNN on one high-resolution image: "
    "one process, spatial 2-way (halo exchange) and pipeline 2-way, plus a gradient check of torch's _tp_conv.",
    out="bench-results/spatial",
    rounds=(3, 1),
    steps=None,
    ranks_help="ranks",
    quick_help="a 128x128 image, 1 round (a smoke test)",
    options=_options,
    check=_check,
)


def parse(argv: list[str]) -> Options:
    return harness.parse(BENCH, argv)


def launch(argv: list[str]) -> int:
    """Start the benchmark on its ranks (mpiexec beside this Python) and return its exit code."""
    return harness.launch(BENCH, argv)


def main(argv: Optional[list[str]] = None) -> int:
    return harness.main(BENCH, launch, worker, argv)


# --------------------------------------------------------------------------- model
def resnet_layers(width: int, classes: int = 10) -> list:
    """A small ResNet: stem, two residual blocks, a stride-2 block with a 1x1 shortcut, one more block, the head."""
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU()
            self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.shortcut = (
                nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))
                if stride != 1 or cin != cout
                else nn.Identity()
            )

        def forward(self, x: Any) -> Any:
            y = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
            return self.relu(y + self.shortcut(x))

    stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
    return [
        stem,
        Block(width, width, 1),
        Block(width, width, 1),
        Block(width, 2 * width, 2),
        Block(2 * width, 2 * width, 1),
        nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, classes)),
    ]


def make_model(width: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*resnet_layers(width))


# --------------------------------------------------------------------------- contenders
def _step(model: Any, opt: Any, x: Any, y: Any) -> Any:
    import torch.nn.functional as F

    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def measure(name: str, options: Options, comm: Any, x: Any, y: Any) -> tuple[float, int]:
    """(seconds of one training step, peak activation bytes on this rank) for one contender."""
    import torch
    import torch.nn.functional as F

    from hpdl.parallel import Pipeline
    from hpdl.parallel.pipe.memory import ActivationMeter
    from hpdl.parallel.spatial import SpatialParallel, shard

    meter = ActivationMeter()
    comm.barrier()
    if name == "single":
        seconds = 0.0
        if comm.rank == 0:
            model = make_model(options.width)
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
            _step(model, opt, x, y)  # warm-up
            with meter:
                started = time.perf_counter()
                _step(model, opt, x, y)
                seconds = time.perf_counter() - started
        comm.barrier()
        return seconds, meter.peak
    if name == "spatial":
        model = SpatialParallel(make_model(options.width), comm, dim=2)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        local = shard(x, comm, 2)
        _step(model, opt, local, y)
        comm.barrier()
        with meter:
            started = time.perf_counter()
            _step(model, opt, local, y)
            seconds = time.perf_counter() - started
        return seconds, meter.peak
    pipe = Pipeline(make_model(options.width), comm, chunks=1, checkpoint="never", balance=[3, 3])
    opt = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9)
    first = pipe.is_first
    for timed in (False, True):
        comm.barrier()
        with meter:
            started = time.perf_counter()
            opt.zero_grad()
            pipe.step(x if first else None, None if first else y, F.cross_entropy)
            opt.step()
            seconds = time.perf_counter() - started
        if not timed:
            meter.reset_peak()
    pipe.close()
    return seconds, meter.peak


def halo_overlap(options: Options, comm: Any, x: Any, y: Any) -> dict[str, float]:
    """Seconds per step waiting for halos with and without overlap (two steps each after a warm-up)."""
    import torch

    from hpdl.parallel.spatial import SpatialParallel, shard

    model = SpatialParallel(make_model(options.width), comm, dim=2)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    local = shard(x, comm, 2)
    _step(model, opt, local, y)
    out: dict[str, float] = {}
    for overlap in (True, False, True, False):
        model.set_overlap(overlap)
        model.reset_halo_stats()
        comm.barrier()
        _step(model, opt, local, y)
        stats = model.halo_stats
        key = "overlap" if overlap else "blocking"
        out[f"wait_{key}"] = out.get(f"wait_{key}", 0.0) + stats.wait_seconds / 2
        out[f"interior_{key}"] = out.get(f"interior_{key}", 0.0) + stats.interior_seconds / 2
        out["halo_bytes_per_step"] = float(stats.bytes_sent)
    return out


def tp_conv_probe(gloo: Any) -> dict[str, Any]:
    """Largest errors of torch's DTensor width-split convolution against one process, on one 3x3 conv."""
    import torch
    import torch.distributed as dist

    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        return {"runs": False, "error": f"{type(exc).__name__}: {exc}"}
    torch.manual_seed(1)
    x = torch.randn(1, 4, 32, 32, dtype=torch.float64)
    w = torch.randn(4, 4, 3, 3, dtype=torch.float64)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    torch.nn.functional.conv2d(xr, wr, padding=1).pow(2).sum().backward()
    with torch.no_grad():
        ref = torch.nn.functional.conv2d(x, w, padding=1)

    def error(got: Any, want: Any) -> Any:
        if got is None:
            return "None (no gradient)"
        if got.shape != want.shape:
            return f"wrong shape {tuple(got.shape)} (want {tuple(want.shape)})"
        return float((got - want).abs().max())

    result: dict[str, Any] = {"runs": True}
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        xd = distribute_tensor(x.clone(), mesh, [Shard(3)]).requires_grad_(True)
        wd = distribute_tensor(w.clone(), mesh, [Replicate()]).requires_grad_(True)
        y = torch.nn.functional.conv2d(xd, wd, padding=1)
        result["output_error"] = error(y.full_tensor(), ref)  # type: ignore[attr-defined]
    except Exception as exc:
        return {"runs": False, "error": f"forward: {type(exc).__name__}: {str(exc)[:200]}"}
    try:
        y.pow(2).sum().backward()
        gx = None if xd.grad is None else xd.grad.full_tensor()  # type: ignore[attr-defined]
        gw = None if wd.grad is None else wd.grad.full_tensor()  # type: ignore[attr-defined]
        result["input_grad_error"], result["weight_grad_error"] = error(gx, xr.grad), error(gw, wr.grad)
    except Exception as exc:
        result["input_grad_error"] = result["weight_grad_error"] = (
            f"backward raised {type(exc).__name__}: {str(exc)[:120]}"
        )
    return result


# --------------------------------------------------------------------------- worker
def worker(options: Options) -> int:
    return harness.worker(
        lambda ranks: measure_all(options, ranks),
        lambda ranks, records, elapsed: _write(options, ranks, records, elapsed),
        timeout=600.0,
        announce=lambda r: (
            f"{r.size} ranks, MPI {r.mpi.engine}; image {options.size}^2, width {options.width}; measuring ..."
        ),
        finalize=False,
    )


def measure_all(options: Options, ranks: Ranks) -> list[dict[str, Any]]:
    """Every contender, round after round, then the halo exchange and torch's _tp_conv: the records."""
    import torch

    mpi = ranks.mpi
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, options.size, options.size, generator=g)
    y = torch.randint(0, 10, (1,), generator=g)
    times: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    peaks: dict[str, list[int]] = {c: [0] * mpi.size for c in CONTENDERS}
    for _ in range(options.rounds):
        for name in CONTENDERS:
            seconds, peak = measure(name, options, mpi, x, y)
            slowest = torch.tensor([seconds], dtype=torch.float64)
            mpi.allreduce(slowest, "max")
            times[name].append(float(slowest))
            all_peaks = mpi.allgather(torch.tensor([peak], dtype=torch.int64), sizes=[1] * mpi.size).tolist()
            peaks[name] = [max(a, int(b)) for a, b in zip(peaks[name], all_peaks)]
    overlap = halo_overlap(options, mpi, x, y)
    probe = tp_conv_probe(ranks.gloo)
    single_peak = peaks["single"][0]
    records = []
    for name in CONTENDERS:
        per_rank = [p for p in peaks[name] if p] or [0]
        ratio = max(per_rank) / single_peak if single_peak else None
        records.append(
            {
                "contender": name,
                "samples_per_s": report.summarize([1.0 / t for t in times[name]]),
                "peak_activation_bytes": peaks[name],
                "peak_ratio": ratio,
            }
        )
    # clamped: on a noisy machine the overlapped steps may wait longer than the blocking ones (nothing hidden);
    # both waits stay in the report and the record
    waited = overlap["wait_overlap"] / overlap["wait_blocking"] if overlap["wait_blocking"] > 0 else 1.0
    records.append({"contender": "halo", **overlap, "hidden_fraction": min(1.0, max(0.0, 1.0 - waited))})
    records.append({"contender": "torch-tp-conv", **probe})
    return records


def _write(options: Options, ranks: Ranks, records: list[dict[str, Any]], elapsed: float) -> None:
    by = {r["contender"]: r for r in records}
    overlap, probe, hidden = by["halo"], by["torch-tp-conv"], by["halo"]["hidden_fraction"]
    single_peak = by["single"]["peak_activation_bytes"][0]
    rows = []
    for name in CONTENDERS:
        s, peak = by[name]["samples_per_s"], max([p for p in by[name]["peak_activation_bytes"] if p] or [0])
        rows.append(
            [name, s["median"], f"{s['min']:.3g}-{s['max']:.3g}", report.format_bytes(peak), by[name]["peak_ratio"]]
        )
    table = report.markdown_table(["contender", "samples/s", "min-max", "peak act./rank", "vs one process"], rows)
    med = {name: by[name]["samples_per_s"]["median"] for name in CONTENDERS}
    halo = report.markdown_table(
        ["halo exchange per step", "value"],
        [
            ["bytes sent per rank", report.format_bytes(int(overlap["halo_bytes_per_step"]))],
            ["wait, overlapped (s)", overlap["wait_overlap"]],
            ["wait, not overlapped (s)", overlap["wait_blocking"]],
            ["interior computed while in flight (s)", overlap["interior_overlap"]],
            ["hidden fraction", hidden],
        ],
    )
    probe_line = (
        f"torch _tp_conv (DTensor, width split, one 3x3 conv, float64): output error {probe.get('output_error')}, "
        f"input-gradient error {probe.get('input_grad_error')}, weight-gradient error {probe.get('weight_grad_error')}"
        if probe.get("runs")
        else f"torch _tp_conv: does not run here ({probe.get('error')})"
    )
    spatial_memory = max(by["spatial"]["peak_activation_bytes"]) / single_peak if single_peak else float("nan")
    targets = [
        f"{report.verdict(med['spatial'] >= TARGET_VS_PIPELINE * med['pipeline'])} spatial >= {TARGET_VS_PIPELINE}x "
        f"pipeline: {med['spatial'] / med['pipeline']:.2f}x",
        f"{report.verdict(spatial_memory <= TARGET_MEMORY)} spatial peak activations per rank <= {TARGET_MEMORY}x one "
        f"process: {spatial_memory:.2f}x",
        f"{report.verdict(hidden >= TARGET_HIDDEN)} halo exchange hidden >= {TARGET_HIDDEN:.0%}: {hidden:.0%}",
    ]
    notes = [
        "one training step per round per contender, rounds alternating; the machine may be shared, compare the "
        "contenders of this run only",
        probe_line,
    ]
    header = (
        f"hpdl bench train --strategy spatial: {ranks.size} ranks, OMP_NUM_THREADS=1, ResNet-style CNN width "
        f"{options.width}, one {options.size}x{options.size} image, {options.rounds} rounds"
    )
    config = harness.config(options, ranks, size=options.size, width=options.width)
    harness.write(options, "spatial", ("Spatial parallelism", header, [table, halo], notes, targets), records, config,
                  elapsed)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
