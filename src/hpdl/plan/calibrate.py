"""Measure this machine and write it as a cluster: compute rate per dtype, memory bandwidth, collectives.

- compute: square matmuls (2 n^3 FLOPs), one thread (what one rank with
  OMP_NUM_THREADS=1 gets) and all cores (what the ranks of the node share);
- per-layer overhead: forward and backward of a stack of tiny Linear layers
  (framework dispatch, not arithmetic), divided by 3 x layers;
- memory bandwidth: a large tensor copy (read + write);
- collectives: allreduce and send/recv of hpdl's MPI communicator on 2
  ranks (a short direct run, `python -m hpdl.plan.calibrate --worker`), or
  the records of an `hpdl bench comm` run; latency and bandwidth are fitted
  to the alpha-beta model (2-rank ring allreduce: 2 alpha + S / B).

One node: the inter-node link is written equal to the intra-node one and
marked as such. Across hosts (`hosts=parse_hosts("a:2,b:2")`, `rsh`): one
probe on every slot measures the two levels apart, each as the cost model
counts it (bandwidth per device and direction): inside each host (shared
memory) with every host busy at once, and between the hosts with every
local rank crossing at once (one NIC per host is shared by its ranks); the
compute rate every rank gets while all of them compute sets `node_flops`.
Numbers from a busy machine describe a busy machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import tempfile
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

from hpdl.plan.cluster import GB, Cluster, Link

if TYPE_CHECKING:
    from hpdl.runtime.hosts import Hosts

__all__ = ["measure_compute", "measure_overhead", "measure_memory_bandwidth", "fit_alpha_beta",
           "measure_collectives", "measure_hosts", "measure_busy", "collectives_from_bench", "calibrate",
           "main"]  # fmt: skip

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp64": "float64"}


def _best_time(fn: Any, reps: int) -> float:
    """Median seconds of `reps` calls after one warm-up: the statistic `validate` reports for steps too."""
    fn()
    samples = []
    for _ in range(max(reps, 1)):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_compute(size: int = 512, reps: int = 3, threads: Optional[int] = None) -> dict[str, float]:
    """Matmul FLOP/s per dtype with `threads` torch threads (None: as set)."""
    import torch

    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        rates = {}
        for name, attr in DTYPES.items():
            dtype = getattr(torch, attr)
            a = torch.randn(size, size).to(dtype)
            bm = torch.randn(size, size).to(dtype)
            seconds = _best_time(lambda a=a, bm=bm: torch.mm(a, bm), reps)
            rates[name] = 2.0 * size**3 / seconds
        return rates
    finally:
        torch.set_num_threads(previous)


def measure_overhead(layers: int = 32, reps: int = 5) -> dict[str, float]:
    """Fixed seconds per operator and per layer in forward (backward counted as two forwards), and per
    parameter tensor in an Adam step: what a tiny model pays regardless of its FLOPs."""
    import torch
    from torch import nn

    class Ops(nn.Module):
        def __init__(self, count: int):
            super().__init__()
            self.count = count
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(self.count):
                x = x * self.w
            return x

    x = torch.randn(1, 4)
    many_ops = Ops(layers * 4)
    per_op = _best_time(lambda: many_ops(x).sum().backward(), reps) / (3 * layers * 4)
    chain = nn.Sequential(*[Ops(1) for _ in range(layers)])
    per_layer = _best_time(lambda: chain(x).sum().backward(), reps) / (3 * layers) - per_op
    params = [nn.Parameter(torch.ones(4)) for _ in range(layers)]
    for p in params:
        p.grad = torch.ones(4)
    adam = torch.optim.Adam(params, lr=1e-3)
    per_tensor = _best_time(adam.step, reps) / layers
    # A whole step of a one-layer model, minus what the terms above already count: loss, autograd start,
    # zero_grad and the optimizer's own dispatch, paid once per forward-backward pass.
    tiny = nn.Linear(4, 4)
    tiny_adam = torch.optim.Adam(tiny.parameters(), lr=1e-3)
    y = torch.randint(0, 4, (1,))

    def step() -> None:
        nn.functional.cross_entropy(tiny(x), y).backward()
        tiny_adam.step()
        tiny_adam.zero_grad()

    per_pass = _best_time(step, reps) - 3 * (per_layer + 2 * per_op) - 2 * per_tensor
    return {"op": max(per_op, 0.0), "layer": max(per_layer, 0.0), "tensor": max(per_tensor, 0.0),
            "pass": max(per_pass, 0.0)}  # fmt: skip


def measure_optimizers(params: int = 1 << 20, reps: int = 3) -> dict[str, float]:
    """Nanoseconds per parameter of one optimizer step (Adam; SGD with momentum), one thread, as ranks run it."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for name, make in (
            ("adam", lambda ps: torch.optim.Adam(ps, lr=1e-3)),
            ("sgd-momentum", lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)),
        ):
            p = torch.nn.Parameter(torch.ones(params))
            p.grad = torch.full((params,), 1e-3)
            opt = make([p])
            out[name] = _best_time(opt.step, reps) / params * 1e9
        return out
    finally:
        torch.set_num_threads(threads)


def measure_memory_bandwidth(mbytes: int = 64, reps: int = 3) -> float:
    """Bytes per second of a tensor copy (read and write counted)."""
    import torch

    n = mbytes * (1 << 20) // 4
    src = torch.ones(n)
    dst = torch.empty(n)
    return 2 * n * 4 / _best_time(lambda: dst.copy_(src), reps)


def fit_alpha_beta(points: Sequence[tuple[float, float]], latency_factor: float, bandwidth_factor: float) -> Link:
    """Least-squares fit of t = latency_factor * alpha + bandwidth_factor * S / B to (S bytes, t seconds) points.

    Each point is weighted by 1/t, so that small messages (latency) and
    large ones (bandwidth) count alike. A negative intercept (noise) becomes
    the smallest message's time; a non-positive slope, the largest message's.
    """
    import numpy as np

    if len(points) < 2:
        raise ValueError("fit_alpha_beta: need at least two (size, time) points")
    sizes = np.array([p[0] for p in points], dtype=float)
    times = np.array([p[1] for p in points], dtype=float)
    w = 1.0 / times
    design = np.stack([latency_factor * np.ones_like(sizes), bandwidth_factor * sizes], axis=1) * w[:, None]
    (alpha, inv_b), *_ = np.linalg.lstsq(design, times * w, rcond=None)
    alpha = float(alpha)
    if alpha <= 0:  # noise pushed the intercept below zero: the smallest message is all latency
        alpha = float(times[np.argmin(sizes)]) / latency_factor
    if inv_b <= 0:  # no visible bandwidth term: take it from the largest message alone
        inv_b = max((times[-1] - latency_factor * alpha) / (bandwidth_factor * sizes[-1]), 1e-15)
    return Link("measured", alpha, 1.0 / float(inv_b))


# --------------------------------------------------------------------------- collectives
SIZES = (4, 4096, 65536, 1 << 20, 4 << 20)
QUICK_SIZES = (4, 65536, 1 << 20)


def _worker(out: str, sizes: Sequence[int], reps: int) -> None:
    """On every rank: time allreduce and a ping-pong; rank 0 writes the medians (seconds) as JSON."""
    import statistics

    import torch

    import hpdl

    comm = hpdl.init("mpi")
    try:
        results: dict[str, list[tuple[int, float]]] = {"allreduce": [], "sendrecv": []}
        for nbytes in sizes:
            t = torch.ones(max(1, nbytes // 4))
            samples = []
            for i in range(reps + 2):
                comm.barrier()
                start = time.perf_counter()
                comm.allreduce(t)
                if i >= 2:
                    samples.append(time.perf_counter() - start)
            results["allreduce"].append((nbytes, statistics.median(samples)))
            samples = []
            for i in range(reps + 2):
                comm.barrier()
                start = time.perf_counter()
                if comm.rank == 0:
                    comm.send(t, 1)
                    comm.recv(t, 1)
                elif comm.rank == 1:
                    comm.recv(t, 0)
                    comm.send(t, 0)
                if i >= 2:
                    samples.append((time.perf_counter() - start) / 2)
            results["sendrecv"].append((nbytes, statistics.median(samples)))
        if comm.rank == 0:
            with open(out, "w") as fh:
                json.dump({"ranks": comm.size, "engine": str(getattr(comm, "engine", "mpi")), **results}, fh)
    finally:
        hpdl.finalize()


def measure_collectives(ranks: int = 2, quick: bool = False, timeout: float = 300.0) -> dict[str, Any]:
    """Run the collective probe on `ranks` MPI ranks; returns the fitted links and the raw medians."""
    from hpdl.runtime import spawn

    sizes = QUICK_SIZES if quick else SIZES
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "collectives.json")
        args = ["-m", "hpdl.plan.calibrate", "--worker", out, "--sizes", *map(str, sizes)]
        args += ["--reps", "5" if quick else "20"]
        env = spawn.job_environment("mpi", ranks)
        env["OMP_NUM_THREADS"] = "1"
        code = spawn.run(ranks, args, env=env, timeout=timeout, name="hpdl plan calibrate")
        if code != 0 or not os.path.exists(out):
            raise RuntimeError(f"hpdl plan calibrate: the {ranks}-rank collective probe failed (exit code {code})")
        with open(out) as fh:
            data = json.load(fh)
    return _fit(data["ranks"], data["allreduce"], data["sendrecv"], source=f"direct probe ({data['engine']})")


# --------------------------------------------------------------------------- every rank busy at once
BUSY_PARTS = 5
"""The busy window is timed in this many parts, and the median part counts: one part that met a passing load (another
process, the hypervisor) moved the whole window's rate by 28% (38 against 50-53 GF/s per rank here)."""


def _concurrent_rates(comm: Any, matmul: int, window: float) -> dict[str, float]:
    """FLOP/s by dtype of the slowest rank while every rank of `comm` multiplies matrices (one thread each) for the
    same window of time, so that all of them run at once (ranks that share cores each get their share); the median
    of BUSY_PARTS parts of the window."""
    import torch

    torch.set_num_threads(1)
    rates = {}
    for name, attr in DTYPES.items():
        dtype = getattr(torch, attr)
        a = torch.randn(matmul, matmul).to(dtype)
        b = torch.randn(matmul, matmul).to(dtype)
        torch.mm(a, b)
        parts = []
        for _ in range(BUSY_PARTS):
            comm.barrier()
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < window / BUSY_PARTS:
                torch.mm(a, b)
                count += 1
            parts.append(min(comm.allgather_object(2.0 * matmul**3 * count / (time.perf_counter() - start))))
        rates[name] = statistics.median(parts)
    return rates


def _worker_busy(out: str, matmul: int, window: float) -> None:
    """On every rank of the job: the matmul rate and the fixed cost per operator while every rank computes at
    once (ranks that share cores each get their share); rank 0 writes the slowest rank's, as JSON."""
    import torch

    import hpdl

    comm = hpdl.init("mpi")
    try:
        rates = _concurrent_rates(comm, matmul, window)
        w = torch.ones(4, requires_grad=True)
        x = torch.randn(1, 4)
        comm.barrier()
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < window:  # 32 operators forward, their backward: the fixed costs
            y = x
            for _ in range(32):
                y = y * w
            y.sum().backward()
            count += 1
        per_op = max(comm.allgather_object((time.perf_counter() - start) / (count * 3 * 32)))
        if comm.rank == 0:
            with open(out, "w") as fh:
                json.dump({"ranks": comm.size, "flops": rates, "op_s": per_op}, fh)
    finally:
        hpdl.finalize()


def measure_busy(devices: int, quick: bool = False, timeout: float = 300.0) -> dict[str, Any]:
    """Compute rates per rank (FLOP/s by dtype) and the fixed seconds per operator with `devices` ranks of one
    thread each computing at once on this machine: what each rank of a job of that size gets."""
    from hpdl.runtime import spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "busy.json")
        args = ["-m", "hpdl.plan.calibrate", "--worker", out, "--busy-probe", "--matmul", "256" if quick else "512"]
        args += ["--window", "0.25" if quick else "1.0"]
        env = spawn.job_environment("mpi", devices)
        env["OMP_NUM_THREADS"] = "1"
        code = spawn.run(devices, args, env=env, timeout=timeout, name="hpdl plan calibrate")
        if code != 0 or not os.path.exists(out):
            raise RuntimeError(f"hpdl plan calibrate: the {devices}-rank compute probe failed (exit code {code})")
        with open(out) as fh:
            data: dict[str, Any] = json.load(fh)
    return data


# --------------------------------------------------------------------------- across hosts
HOST_SIZES = (4, 65536, 1 << 20, 4 << 20)
QUICK_HOST_SIZES = (4, 65536, 1 << 20, 2 << 20)
"""Largest messages well past the token bucket's burst (a shaped link passes 256 KB at wire speed)."""


def _timed(comm: Any, active: bool, op: Any, reps: int, per: float = 1.0) -> Optional[float]:
    """Median seconds of `op` on the ranks where `active`, every repetition started together (world barrier)."""
    samples = []
    for i in range(reps + 1):
        comm.barrier()
        start = time.perf_counter()
        if active:
            op()
        if i >= 1:
            samples.append((time.perf_counter() - start) / per)
    return statistics.median(samples) if active else None


def _probe_pair(comm: Any, sub: Any, active: bool, sizes: Sequence[int], reps: int) -> dict[str, list[Any]]:
    """Allreduce on `sub` and a ping-pong between its ranks 0 and 1, where `active` (every rank calls it)."""
    import torch

    out: dict[str, list[Any]] = {"allreduce": [], "sendrecv": []}
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4))

        def ping(t: Any = t) -> None:
            if sub.rank == 0:
                sub.send(t, 1)
                sub.recv(t, 1)
            elif sub.rank == 1:
                sub.recv(t, 0)
                sub.send(t, 0)

        out["allreduce"].append((nbytes, _timed(comm, active, lambda t=t: sub.allreduce(t), reps)))
        out["sendrecv"].append((nbytes, _timed(comm, active, ping, reps, per=2.0)))
    return out


def _worker_hosts(out: str, sizes: Sequence[int], reps: int, matmul: int, window: float = 0.5) -> None:
    """On every rank of a job across hosts: each level alone, as the ranks of a training step load it."""
    import torch

    import hpdl

    comm = hpdl.init("mpi")
    try:
        names = comm.allgather_object(socket.gethostname())
        order = list(dict.fromkeys(names))
        host = order.index(names[comm.rank])
        local = names[: comm.rank].count(names[comm.rank])
        node = comm.split(host, comm.rank)
        cross = comm.split(local, comm.rank)
        assert node is not None and cross is not None
        results: dict[str, Any] = {"ranks": comm.size, "hosts": [[h, names.count(h)] for h in order]}
        # inside every host at once (shared memory), then between the hosts with every local rank crossing at
        # once (what a data-parallel step does), then one pair alone (the NIC's whole rate), then the world
        results["intra"] = _probe_pair(comm, node, True, sizes, reps)
        results["inter"] = _probe_pair(comm, cross, True, sizes, reps)
        results["inter_alone"] = _probe_pair(comm, cross, local == 0, sizes, reps)
        world = []
        for nbytes in sizes:
            t = torch.ones(max(1, nbytes // 4))
            world.append((nbytes, _timed(comm, True, lambda t=t: comm.allreduce(t), reps)))
        results["world_allreduce"] = world
        # the rate each rank computes at while every rank of the job does (hosts may share cores): every rank
        # multiplies for the same window of time, so that all of them run at once
        rates = _concurrent_rates(comm, matmul, window)
        results["concurrent_flops"] = rates
        if comm.rank == 0:
            with open(out, "w") as fh:
                json.dump(results, fh)
    finally:
        hpdl.finalize()


def measure_hosts(
    hosts: Hosts, rsh: str = "ssh", quick: bool = False, timeout: float = 300.0, ranks: Optional[int] = None
) -> dict[str, Any]:
    """Run the probe on the hosts' slots (`ranks`, default all); the intra- and inter-host links fitted apart.

    Each link is per device and direction, as `hpdl.plan.collectives` counts it: the intra link from an
    allreduce inside each host (every host at once), the inter link from an allreduce between the hosts with
    every local rank crossing at once (2 hosts: 2 alpha + S / B per rank), so that ranks sharing a host's
    NIC each get their share.
    """
    from hpdl.runtime import spawn

    n = ranks or hosts.total
    placed = hosts.placement(n)
    per_node = {count for _, count in placed}
    if len(placed) < 2 or len(per_node) != 1 or min(per_node) < 2:
        raise ValueError(
            f"hpdl plan calibrate -H {hosts.spec(n)}: the probe needs two hosts or more with the same number of "
            "ranks each, at least 2 (e.g. a:2,b:2)"
        )
    sizes = QUICK_HOST_SIZES if quick else HOST_SIZES
    with tempfile.TemporaryDirectory() as tmp:  # the hosts share a file system, as the job's files need
        out = os.path.join(tmp, "hosts.json")
        args = ["-m", "hpdl.plan.calibrate", "--worker", out, "--hosts-probe", "--sizes", *map(str, sizes)]
        args += ["--reps", "3" if quick else "10", "--matmul", "256" if quick else "512"]
        args += ["--window", "0.25" if quick else "1.0"]
        env = spawn.job_environment("mpi", n, hosts=hosts)
        env["OMP_NUM_THREADS"] = "1"
        code = spawn.run(n, args, env=env, timeout=timeout, name="hpdl plan calibrate", hosts=hosts, rsh=rsh)
        if code != 0 or not os.path.exists(out):
            raise RuntimeError(f"hpdl plan calibrate: the probe on {hosts.spec(n)} failed (exit code {code})")
        with open(out) as fh:
            data = json.load(fh)
    k = data["hosts"][0][1]
    nodes = len(data["hosts"])
    intra = _fit(k, data["intra"]["allreduce"], data["intra"]["sendrecv"], source="shared memory inside a host")
    inter = _fit(nodes, data["inter"]["allreduce"], data["inter"]["sendrecv"], "between hosts", sustained=True)
    alone = _fit(nodes, data["inter_alone"]["allreduce"], data["inter_alone"]["sendrecv"], "one pair", sustained=True)
    return {"nodes": nodes, "per_node": k, "intra": intra, "inter": inter, "inter_alone": alone, "raw": data}


def _sustained(points: Sequence[tuple[float, float]], bandwidth_factor: float, fitted: Link) -> float:
    """Bytes per second from the slope between the two largest messages (the fit's, if they do not rise)."""
    (s1, t1), (s2, t2) = sorted(points)[-2:]
    if s2 <= s1 or t2 <= t1:
        return fitted.bandwidth_Bps
    return bandwidth_factor * (s2 - s1) / (t2 - t1)


def collectives_from_bench(path: str, column: str = "hpdl-mpi") -> dict[str, Any]:
    """Fit the links from the records of `hpdl bench comm` (comm.json)."""
    with open(path) as fh:
        records = json.load(fh)
    chosen = [r for r in records if r.get("column") == column and r.get("section", "ops") != "copy"]
    allreduce = sorted((int(r["bytes"]), r["median_us"] * 1e-6) for r in chosen if r.get("op") == "allreduce")
    sendrecv = sorted((int(r["bytes"]), r["median_us"] * 1e-6) for r in chosen if r.get("op") == "sendrecv")
    if len(allreduce) < 2:
        raise ValueError(f"{path}: fewer than two allreduce records of column {column!r}; run `hpdl bench comm`")
    ranks = int(chosen[0].get("ranks", 2))
    return _fit(ranks, allreduce, sendrecv, source=f"hpdl bench comm records ({path}, {column})")


def _fit(
    ranks: int, allreduce: Sequence[Any], sendrecv: Sequence[Any], source: str, sustained: bool = False
) -> dict[str, Any]:
    """`sustained`: the bandwidth a link keeps up, from its two largest messages (between hosts: a shaped link's
    token bucket, or a NIC's buffers, let the first tens of KB through at once; fitted with them, a 64 KiB message
    that met a full bucket made a 25 MB/s link look 1.3 GB/s)."""
    n = ranks
    # Ring allreduce on n ranks: 2 (n-1) alpha + 2 (n-1)/n S / B.
    link = fit_alpha_beta([tuple(p) for p in allreduce], 2 * (n - 1), 2 * (n - 1) / n)
    if sustained:
        link = Link(link.name, link.latency_s, _sustained([tuple(p) for p in allreduce], 2 * (n - 1) / n, link))
    p2p = fit_alpha_beta([tuple(p) for p in sendrecv], 1, 1) if len(sendrecv) >= 2 else None
    if sustained and p2p is not None:
        p2p = Link(p2p.name, p2p.latency_s, _sustained([tuple(p) for p in sendrecv], 1, p2p))
    return {
        "ranks": n,
        "source": source,
        "link": link,
        "p2p": p2p,
        "allreduce_s": [list(p) for p in allreduce],
        "sendrecv_s": [list(p) for p in sendrecv],
    }


# --------------------------------------------------------------------------- the cluster
def calibrate(
    *,
    devices: int = 4,
    ranks: int = 2,
    quick: bool = False,
    bench_json: Optional[str] = None,
    overlap: float = 0.0,
    measure_comm: bool = True,
    hosts: Optional[Hosts] = None,
    rsh: str = "ssh",
) -> Cluster:
    """Measure this machine and describe it as one node of `devices` devices (one single-threaded rank each).

    With `hosts` (two or more, the same slots each), the cluster is those hosts: one node per host of its
    slots, the links inside and between the hosts measured apart by a probe started through `rsh`
    (`measure_hosts`), and `node_flops` no more than what each rank gets while every rank computes.
    `overlap` is not measured: on CPU the cores that compute also move the
    bytes (shared-memory copies), so 0 (no hiding) is the default.
    """
    cores = os.cpu_count() or 1
    size = 256 if quick else 512
    single = measure_compute(size, 2 if quick else 3, threads=1)
    node = measure_compute(size, 2 if quick else 3, threads=cores) if cores > 1 else dict(single)
    node = {k: max(v, single[k]) for k, v in node.items()}
    overhead = measure_overhead(16 if quick else 32, 3 if quick else 5)
    bandwidth = measure_memory_bandwidth(32 if quick else 128, 3 if quick else 5)
    optimizers = measure_optimizers(1 << 18 if quick else 1 << 21, 2 if quick else 3)
    extra: dict[str, Any] = {"cores": cores, "matmul_size": size, "torch_threads_single": 1}
    if hosts is not None:
        return _across_hosts(
            hosts, rsh, quick, single, node, overhead, bandwidth, optimizers, overlap, extra, devices=devices
        )
    if bench_json:
        comm = collectives_from_bench(bench_json)
    elif measure_comm:
        comm = measure_collectives(ranks, quick=quick)
    else:
        comm = None
    if measure_comm and devices > cores:
        # the rate each rank gets while all of them compute (ranks that outnumber the cores share them): the node's
        # rate is the devices times that, and each rank's share of the cores goes with the file. Not capped by the
        # one-process all-core rate: a different measurement, whose passing dips (123 against 198-214 GF/s in one of
        # four calibrations here) made every oversubscribed prediction 1.5x too slow
        busy = measure_busy(devices, quick=quick)
        extra["all_threads_flops"] = json.dumps(node)  # one process on every core: what node_flops was before
        node = {d: devices * busy["flops"].get(d, rate) for d, rate in node.items()}
        extra["busy_flops"] = json.dumps(busy["flops"])
        extra["busy_op_overhead_us"] = busy["op_s"] * 1e6
    if comm is not None:
        intra = Link("shm (measured)", comm["link"].latency_s, comm["link"].bandwidth_Bps)
        extra["collectives"] = comm["source"]
        extra["allreduce_s"] = json.dumps(comm["allreduce_s"])
        if comm["p2p"] is not None:
            extra["p2p_latency_us"] = comm["p2p"].latency_s * 1e6
            extra["p2p_bandwidth_GBps"] = comm["p2p"].bandwidth_Bps / GB
    else:
        intra = Link("shm (not measured: memory copy)", 5e-6, bandwidth / 2)
        extra["collectives"] = "not measured; latency 5 us assumed, bandwidth = half the copy bandwidth"
    ram = _ram()
    host = socket.gethostname()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return Cluster(
        name=f"{host} ({devices} CPU ranks)",
        nodes=1,
        devices_per_node=devices,
        memory_bytes=ram / devices,
        flops=single,
        node_flops=node,
        intra=intra,
        inter=Link("same as intra (one node)", intra.latency_s, intra.bandwidth_Bps),
        cores_per_device=cores / devices,
        **_machine(bandwidth, overhead, optimizers, overlap),
        source=f"measured on {host} at {when} by hpdl plan calibrate ({cores} cores{', quick' if quick else ''})",
        extra=extra,
    )


def _ram() -> float:
    """This machine's memory in bytes (8 GB where the system does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 * GB


def _machine(
    bandwidth: float, overhead: dict[str, float], optimizers: dict[str, float], overlap: float
) -> dict[str, Any]:
    """What a calibrated cluster says of the machine itself, alone or across hosts: the Cluster's fields."""
    return {
        "efficiency": 1.0,
        "memory_bandwidth_Bps": bandwidth,
        "layer_overhead_s": overhead["layer"],
        "op_overhead_s": overhead["op"],
        "tensor_overhead_s": overhead["tensor"],
        "pass_overhead_s": overhead["pass"],
        "optimizer_ns": optimizers,
        "overlap": overlap,
        "reserved_bytes": 0.3 * GB,
    }


def _across_hosts(
    hosts: Hosts,
    rsh: str,
    quick: bool,
    single: dict[str, float],
    node: dict[str, float],
    overhead: dict[str, float],
    bandwidth: float,
    optimizers: dict[str, float],
    overlap: float,
    extra: dict[str, Any],
    devices: Optional[int] = None,
) -> Cluster:
    probe = measure_hosts(hosts, rsh, quick=quick, ranks=min(devices, hosts.total) if devices else None)
    k, nodes = probe["per_node"], probe["nodes"]
    intra, inter, alone = probe["intra"], probe["inter"], probe["inter_alone"]
    concurrent = probe["raw"]["concurrent_flops"]
    # hosts that share cores (or a node whose ranks crowd its cores) compute at what the busy probe saw
    node = {d: min(rate, k * concurrent.get(d, rate)) for d, rate in node.items()}
    extra = dict(extra)
    extra["collectives"] = f"probe on {hosts.spec(k * nodes)} (every host, every local rank at once)"
    extra["intra_allreduce_s"] = json.dumps(intra["allreduce_s"])
    extra["inter_allreduce_s"] = json.dumps(inter["allreduce_s"])
    extra["world_allreduce_s"] = json.dumps(probe["raw"]["world_allreduce"])
    extra["inter_one_pair_bandwidth_GBps"] = alone["link"].bandwidth_Bps / GB
    extra["inter_one_pair_latency_us"] = alone["link"].latency_s * 1e6
    for level, fitted in (("intra", intra), ("inter", inter)):
        if fitted["p2p"] is not None:
            extra[f"{level}_p2p_latency_us"] = fitted["p2p"].latency_s * 1e6
            extra[f"{level}_p2p_bandwidth_GBps"] = fitted["p2p"].bandwidth_Bps / GB
    extra["concurrent_flops"] = json.dumps(concurrent)
    ram = _ram()
    names = ",".join(h for h, _ in probe["raw"]["hosts"])
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return Cluster(
        name=f"{names} ({nodes} hosts x {k} CPU ranks)",
        nodes=nodes,
        devices_per_node=k,
        memory_bytes=ram / k,
        flops=single,
        node_flops=node,
        intra=Link("shm (measured, every host at once)", intra["link"].latency_s, intra["link"].bandwidth_Bps),
        inter=Link(
            f"network (measured, {k} ranks per host crossing at once)",
            inter["link"].latency_s,
            inter["link"].bandwidth_Bps,
        ),
        **_machine(bandwidth, overhead, optimizers, overlap),
        source=f"measured on hosts {names} at {when} by hpdl plan calibrate -H {hosts.spec(k * nodes)}"
        f"{' (quick)' if quick else ''}",
        extra=extra,
    )


def main(argv: Optional[list[str]] = None) -> int:
    """The collective probe's worker entry (`python -m hpdl.plan.calibrate --worker OUT`)."""
    parser = argparse.ArgumentParser(prog="python -m hpdl.plan.calibrate")
    parser.add_argument("--worker", required=True, help="JSON file rank 0 writes")
    parser.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--hosts-probe", action="store_true", help="the probe across hosts (measure_hosts)")
    parser.add_argument("--busy-probe", action="store_true", help="compute with every rank busy (measure_busy)")
    parser.add_argument("--matmul", type=int, default=512)
    parser.add_argument("--window", type=float, default=0.5, help="seconds every rank multiplies at once")
    ns = parser.parse_args(argv)
    from hpdl.runtime.memory import keep_freed_memory

    keep_freed_memory()  # as `hpdl plan` itself and the validated ranks (hpdl.runtime.memory)
    if ns.hosts_probe:
        _worker_hosts(ns.worker, ns.sizes, ns.reps, ns.matmul, ns.window)
    elif ns.busy_probe:
        _worker_busy(ns.worker, ns.matmul, ns.window)
    else:
        _worker(ns.worker, ns.sizes, ns.reps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
