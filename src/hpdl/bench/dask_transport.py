"""`hpdl bench dask`: Dask's tcp:// beside hpdl's mpi:// on this machine, in one launch of 4 ranks.

Each measurement alternates the transports (a new random order every
repetition) on the same ranks and data:

    ping-pong   the two worker ranks hold one comm of each transport (distributed.comm.connect/listen, the layer
                the scheduler and workers use): round-trip time of one message (a NumPy buffer, 1 B .. 64 MiB);
                latency = RTT / 2; throughput = `window` messages sent back to back, then an acknowledgement.
    workloads   two Dask clusters at once, one per transport (the scheduler rank, the client rank, one worker of
                each cluster on each worker rank, 1 thread each): wall time of (x + x.T).sum() for
                x = da.random.RandomState(0).random_sample((n, n), chunks=c) (20,000 / 2,000 by default), and of
                the data-science workloads of `hpdl.bench.dask_workloads` (a p2p-shuffled groupby-aggregate and
                merge of 10^7 rows, 10^4 delayed tasks of 1 ms, hpdl.ml K-Means on a Dask array); both clusters
                must return the same result. A third cluster, its single worker on the first worker rank, runs
                the same without anything crossing between workers: with the job's CPU seconds it bounds what
                any transport could gain on this machine (a shuffle on 2 busy cores is CPU-bound).

Start it with `hpdl bench dask [--quick]` (this module's `launch`), which runs
`mpiexec -n 4 python -m hpdl.bench.dask_transport --worker ...`: every rank on this machine (scheduler 0,
client 1, workers 2 and 3). With `--link RATE` (root) it makes a simulated two-host cluster
(`hpdl.runtime.sim_cluster`) whose links are shaped to RATE and runs the same on it, the scheduler and one worker
on host a, the client and the other worker on host b (ranks 0, 1 on a; 2, 3 on b; the client is rank 2), so the
ping-pong, the shuffles and every task message cross the link; the cluster is removed afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from hpdl.bench import dask_workloads, report
from hpdl.bench.arguments import positive as _positive

__all__ = ["launch", "main"]

MODULE = "hpdl.bench.dask_transport"
PROTOCOLS = ("tcp", "mpi")
ONE = "one worker"
"""The workloads' bound: a third cluster (tcp://) with a single worker, so no shard or task result crosses between
workers; the best any transport could do is what its time and CPU allow on two (see `_ceiling`)."""
CLUSTERS = (*PROTOCOLS, ONE)
LISTEN = {"tcp": "tcp://127.0.0.1", "mpi": "mpi://"}
RANKS = 4
MIB = 1 << 20
SIZES = (1, 1 << 10, 64 << 10, MIB, 8 * MIB, 64 * MIB)
QUICK_SIZES = (1, 64 << 10, MIB)
TARGET_THROUGHPUT = 1.5
"""mpi:// / tcp:// throughput for messages >= 1 MiB."""
TARGET_EVERY_SIZE = 1.0
"""mpi:// / tcp:// throughput, and tcp:// / mpi:// latency, at every size."""
TARGET_XXT = 1.2
"""tcp:// / mpi:// wall time of the x + x.T sum."""
WORKLOADS = ("x+x.T", *dask_workloads.WORKLOADS)
TARGETS = {"x+x.T": TARGET_XXT, "groupby": 1.2, "merge": 1.2, "tasks": 1.0}
"""tcp:// / mpi:// wall time each workload must reach (K-Means: reported only)."""
LOCAL_ROLES = (0, 1, (2, 3))
HOSTS_ROLES = (0, 2, (1, 3))
"""Scheduler, client and worker ranks: on one machine, and across hosts a (ranks 0, 1) and b (ranks 2, 3)."""


@dataclass(frozen=True)
class Options:
    quick: bool = False
    out: str = "bench-results/dask"
    sizes: tuple[int, ...] = SIZES
    reps: int = 10
    window: int = 8
    n: int = 20_000
    chunk: int = 2_000
    xxt_reps: int = 5
    workloads: tuple[str, ...] = WORKLOADS
    work: dask_workloads.Sizes = field(default_factory=dask_workloads.Sizes)
    timeout: float = 1800.0
    link: str = ""
    """Across two simulated hosts with links shaped to this rate (tc's units); empty: every rank on this machine."""
    worker: bool = False

    def forwarded(self) -> list[str]:
        args = ["--worker", "--out", os.path.abspath(self.out), "--reps", str(self.reps), "--window", str(self.window)]
        args += ["--n", str(self.n), "--chunk", str(self.chunk), "--xxt-reps", str(self.xxt_reps)]
        args += ["--rows", str(self.work.rows), "--tasks", str(self.work.tasks), "--task-ms", str(self.work.task_ms)]
        args += ["--points", str(self.work.points), "--workloads", ",".join(self.workloads) or "none"]
        args += ["--sizes", *(str(s) for s in self.sizes)] + (["--link", self.link] if self.link else [])
        return args + (["--quick"] if self.quick else [])

    @property
    def roles(self) -> tuple[int, int, tuple[int, int]]:
        return HOSTS_ROLES if self.link else LOCAL_ROLES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpdl bench dask",
        description="Dask's tcp:// vs hpdl's mpi:// on loopback: ping-pong latency and throughput (1 B .. 64 MiB) "
        "and the wall time of sum(x + x.T) on 2 workers, alternating in one launch of 4 ranks.",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 repetitions (a smoke test, seconds)")
    parser.add_argument("--out", default="bench-results/dask", help="output folder (default bench-results/dask)")
    parser.add_argument("--sizes", nargs="+", type=report.parse_bytes, help="message sizes (default 1 B .. 64 MiB)")
    parser.add_argument("--reps", type=_positive(int), help="ping-pong repetitions per size (default 10)")
    parser.add_argument("--window", type=_positive(int), default=8, help="messages per throughput sample (8)")
    parser.add_argument("--n", type=_positive(int), help="x is n x n (default 20000)")
    parser.add_argument("--chunk", type=_positive(int), help="chunk edge (default 2000)")
    parser.add_argument(
        "--xxt-reps", type=_positive(int), help="repetitions per transport of x + x.T and each workload (default 5)"
    )
    parser.add_argument("--rows", type=_positive(int), help="rows of the groupby's and each merged frame (10^7)")
    parser.add_argument("--tasks", type=_positive(int), help="delayed tasks of the small-task workload (10^4)")
    parser.add_argument("--task-ms", type=_positive(float), help="each small task sleeps this many ms (1)")
    parser.add_argument("--points", type=_positive(int), help="K-Means points (x 16 features; default 10^6)")
    parser.add_argument(
        "--workloads", help=f"comma-separated, of {','.join(WORKLOADS)} (default all); 'none' for the ping-pong only"
    )
    parser.add_argument(
        "--link", help="across two simulated hosts whose links are shaped to this rate (root; e.g. 1gbit, 100mbit)"
    )
    parser.add_argument("--timeout", type=_positive(float), default=1800.0, help="stop the job after this many s")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def _workloads(text: Optional[str]) -> tuple[str, ...]:
    if not text:
        return WORKLOADS
    if text == "none":
        return ()
    chosen = tuple(w for w in text.split(",") if w)
    unknown = [w for w in chosen if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"--workloads: unknown {', '.join(unknown)}; choose from {', '.join(WORKLOADS)} or none")
    return chosen


def parse(argv: Sequence[str]) -> Options:
    parser = build_parser()
    ns = parser.parse_args(list(argv))
    try:
        return _options(ns)
    except ValueError as error:  # argparse's exit (2) with the reason
        parser.error(str(error))
        raise


def _options(ns: argparse.Namespace) -> Options:
    quick = bool(ns.quick)
    default = dask_workloads.Sizes()
    work = dask_workloads.Sizes(
        rows=ns.rows or (40_000 if quick else default.rows),
        tasks=ns.tasks or (200 if quick else default.tasks),
        task_ms=ns.task_ms or default.task_ms,
        points=ns.points or (20_000 if quick else default.points),
        iterations=3 if quick else default.iterations,
    )
    if ns.link:
        from hpdl.bench.cluster import bits_per_second

        bits_per_second(ns.link)  # a bad rate fails here, before any namespace is made
    return Options(
        quick=quick,
        out=ns.out,
        sizes=tuple(ns.sizes or (QUICK_SIZES if quick else SIZES)),
        reps=ns.reps or (2 if quick else 10),
        window=ns.window if not quick else min(ns.window, 4),
        n=ns.n or (1_000 if quick else 20_000),
        chunk=ns.chunk or (250 if quick else 2_000),
        xxt_reps=ns.xxt_reps or (2 if quick else 5),
        workloads=_workloads(ns.workloads),
        work=work,
        link=ns.link or "",
        timeout=ns.timeout,
        worker=bool(ns.worker),
    )


def launch(argv: list[str]) -> int:
    """Start the benchmark on 4 ranks (mpiexec beside this Python, or across a simulated cluster with --link)."""
    return report.launch_parsed(parse, argv, _start)


def _start(options: Options) -> int:
    if not options.link:
        return report.run_worker("hpdl bench dask", MODULE, RANKS, options.forwarded(), options.timeout)
    from hpdl.runtime import sim_cluster

    why = sim_cluster.available()
    if why:
        print(f"hpdl bench dask --link: needs a simulated cluster, which cannot be made here: {why}", file=sys.stderr)
        return 2
    name = "hpdlbenchdask"
    cluster = sim_cluster.up(2, options.link, name)
    try:
        line = [
            sys.executable, "-m", "hpdl.cli.main", "launch", "-n", str(RANKS), "-H", "a:2,b:2",
            "--launcher-exec", sim_cluster.remote_shell(), "-m", MODULE, *options.forwarded(),
        ]  # fmt: skip
        argv_on_a = [sys.executable, "-m", "hpdl.cli.main", "cluster", "--name", name, "exec", "a", *line]
        env = dict(os.environ, HPDL_CLUSTER=name, OMP_NUM_THREADS="1")
        print(f"hpdl bench dask: {RANKS} ranks on simulated hosts a and b, links shaped to {options.link}", flush=True)
        return subprocess.run(argv_on_a, env=env, timeout=options.timeout).returncode
    finally:
        sim_cluster.down(cluster.name)


# --------------------------------------------------------------------------- MPI helpers that keep mpi:// serving
def _quiet_barrier(world: Any, call: Any, timeout: float) -> None:
    """A barrier that sleeps while it waits (a spinning MPI_Barrier would steal the measured ranks' cores), up to
    20 ms at a time.

    Waits here, not on the progress thread (which keeps serving mpi:// meanwhile), and gives up after `timeout`
    seconds: a dead or stuck rank ends the job with an error instead of blocking the transport forever."""
    request = call(world.Ibarrier)
    deadline = time.monotonic() + timeout
    nap = 1e-3
    while not call(request.Test):
        if time.monotonic() > deadline:
            raise TimeoutError(f"hpdl bench dask: a rank is still busy after {timeout:g} s at a barrier")
        time.sleep(nap)
        nap = min(2 * nap, 20e-3)  # a rank that waits out a measurement wakes (and wakes its progress thread)
        # 50 times a second, not 1,000: on 2 cores those wake-ups were part of what the measured ranks timed


# --------------------------------------------------------------------------- ping-pong and throughput
def _payload(nbytes: int) -> Any:
    from distributed.protocol import to_serialize

    return {"data": to_serialize(np.full(nbytes, 7, dtype=np.uint8))}


async def _serve(comm: Any) -> None:
    from distributed.comm import CommClosedError

    try:
        while True:
            msg = await comm.read()
            if isinstance(msg, dict) and msg.get("op") == "stream":
                for _ in range(msg["count"]):
                    await comm.read()
                await comm.write("ack")
            else:
                await comm.write(msg)
    except CommClosedError:
        pass


async def _pingpong_client(options: Options, addresses: dict[str, str]) -> list[dict[str, Any]]:
    from distributed.comm import connect

    comms = {p: await connect(addresses[p], timeout=60) for p in PROTOCOLS}
    records = []
    for nbytes in options.sizes:
        msg = _payload(nbytes)
        reps = options.reps if nbytes < 16 * MIB else max(2, options.reps // 2)
        rtt: dict[str, list[float]] = {p: [] for p in PROTOCOLS}
        rate: dict[str, list[float]] = {p: [] for p in PROTOCOLS}
        for p in PROTOCOLS:  # warm up: connections, buffers, page faults
            await comms[p].write(msg)
            back = await comms[p].read()
            if back["data"].nbytes != nbytes or int(back["data"][-1]) != 7:
                raise RuntimeError(f"{p}: a {nbytes}-byte message came back wrong")
        for r in range(reps):
            for i in np.random.default_rng(r).permutation(len(PROTOCOLS)):
                p = PROTOCOLS[i]
                comm = comms[p]
                start = time.perf_counter()
                await comm.write(msg)
                await comm.read()
                rtt[p].append(time.perf_counter() - start)
                start = time.perf_counter()
                await comm.write({"op": "stream", "count": options.window})
                for _ in range(options.window):
                    await comm.write(msg)
                await comm.read()
                rate[p].append(options.window * nbytes / (time.perf_counter() - start))
        for p in PROTOCOLS:
            records.append(
                {
                    "measurement": "pingpong",
                    "transport": p,
                    "bytes": nbytes,
                    "latency_us": report.summarize([t / 2 * 1e6 for t in rtt[p]]),
                    "throughput_MBps": report.summarize([b / 1e6 for b in rate[p]]),
                    "window": options.window,
                }
            )
    for comm in comms.values():
        await comm.close()
    return records


def _tcp_host(options: Options) -> str:
    """Where this rank's tcp:// listeners bind: loopback on one machine, the host's own address across hosts."""
    if not options.link:
        return "127.0.0.1"
    from hpdl.runtime.addresses import local_addresses

    found = local_addresses()
    if not found:
        raise RuntimeError("hpdl bench dask --link: this host has no IPv4 address off loopback")
    return found[0].address


def measure_pingpong(options: Options, world: Any, call: Any) -> list[dict[str, Any]]:
    """The worker ranks: the first serves, the second measures; the others wait in a sleeping barrier."""
    from distributed.comm import listen

    rank = world.Get_rank()
    server_rank, client_rank = options.roles[2]
    records: list[dict[str, Any]] = []

    async def server() -> None:
        from hpdl.dask.connection import get_hub

        where = {"tcp": f"tcp://{_tcp_host(options)}", "mpi": LISTEN["mpi"]}
        listeners = {p: await listen(where[p], _serve) for p in PROTOCOLS}
        addresses = {p: listener.contact_address for p, listener in listeners.items()}
        await get_hub().wait_request(lambda: world.isend(addresses, dest=client_rank, tag=11))
        await get_hub().wait_request(lambda: world.irecv(source=client_rank, tag=12))  # the client is done
        for listener in listeners.values():
            listener.stop()

    async def client() -> None:
        loop = asyncio.get_running_loop()
        addresses = await loop.run_in_executor(None, call, lambda: world.recv(source=server_rank, tag=11))
        records.extend(await _pingpong_client(options, addresses))
        await loop.run_in_executor(None, call, lambda: world.send("done", dest=server_rank, tag=12))

    if rank == server_rank:
        asyncio.run(server())
    elif rank == client_rank:
        asyncio.run(client())
    _quiet_barrier(world, call, options.timeout)
    return records


# --------------------------------------------------------------------------- workloads on two clusters at once
async def _schedulers(options: Options, world: Any, call: Any) -> None:
    from distributed import Scheduler

    root = options.roles[0]
    async with (
        Scheduler(protocol="tcp", host=_tcp_host(options), dashboard_address="127.0.0.1:0") as tcp,
        Scheduler(protocol="mpi", dashboard_address="127.0.0.1:0") as mpi,
        Scheduler(protocol="tcp", host=_tcp_host(options), dashboard_address="127.0.0.1:0") as one,
    ):
        addresses = {"tcp": tcp.address, "mpi": mpi.address, ONE: one.address}
        await asyncio.get_running_loop().run_in_executor(None, call, lambda: world.bcast(addresses, root=root))
        await asyncio.gather(tcp.finished(), mpi.finished(), one.finished())


async def _workers(options: Options, addresses: dict[str, str], rank: int) -> None:
    from distributed import Worker

    common: dict[str, Any] = {"nthreads": 1, "dashboard": False, "death_timeout": 300}
    async with contextlib.AsyncExitStack() as stack:
        workers = [
            await stack.enter_async_context(
                Worker(addresses["tcp"], protocol="tcp", host=_tcp_host(options), name=f"tcp-{rank}", **common)
            ),
            await stack.enter_async_context(Worker(addresses["mpi"], protocol="mpi", name=f"mpi-{rank}", **common)),
        ]
        if rank == options.roles[2][0]:  # the bound's single worker lives beside the first worker rank's two
            one = Worker(addresses[ONE], protocol="tcp", host=_tcp_host(options), name=f"one-{rank}", **common)
            workers.append(await stack.enter_async_context(one))
        await asyncio.gather(*(w.finished() for w in workers))


def _xxt(options: Options) -> Any:
    import dask.array as da

    x = da.random.RandomState(0).random_sample((options.n, options.n), chunks=options.chunk)
    return (x + x.T).sum()


def _run_workload(name: str, options: Options, client: Any) -> tuple[float, Any]:
    if name == "x+x.T":
        start = time.perf_counter()
        total = float(client.compute(_xxt(options)).result())
        return time.perf_counter() - start, total
    return dask_workloads.run(name, client, options.work)


def _sizes_of(name: str, options: Options) -> str:
    work = options.work
    return {
        "x+x.T": f"n {options.n} / chunk {options.chunk}",
        "groupby": f"{work.rows:,} rows, {max(1, work.rows // 10):,} groups",
        "merge": f"{work.rows:,} x {work.rows:,} rows",
        "tasks": f"{work.tasks:,} tasks x {work.task_ms:g} ms",
        "kmeans": f"{work.points:,} x 16, k=8, {work.iterations} iterations",
    }[name]


def _job_cpu_seconds(client: Any) -> float:
    """CPU seconds (every thread) used so far by the job's four processes: the workers' ranks (which hold a worker
    of every cluster), the schedulers' rank and this client's."""
    workers = client.run(time.process_time)
    return float(sum(workers.values()) + client.run_on_scheduler(time.process_time) + time.process_time())


def _workloads_client(options: Options, addresses: dict[str, str]) -> list[dict[str, Any]]:
    """Each workload: a warm-up on each cluster, then `xxt_reps` runs alternating in a random order, each with the
    job's CPU seconds; the checks of every run must agree across the clusters (else the benchmark stops with all
    results)."""
    from distributed import Client

    clients = {p: Client(addresses[p], timeout=120) for p in CLUSTERS}
    records: list[dict[str, Any]] = []
    try:
        for p, c in clients.items():
            c.wait_for_workers(1 if p == ONE else 2, timeout=120)
        for name in options.workloads:
            times: dict[str, list[float]] = {p: [] for p in CLUSTERS}
            cpu: dict[str, list[float]] = {p: [] for p in CLUSTERS}
            checks: dict[str, list[Any]] = {p: [] for p in CLUSTERS}
            for p in CLUSTERS if not options.quick else ():  # warm up (imports, connections, compiled kernels)
                checks[p].append(_run_workload(name, options, clients[p])[1])
            for r in range(options.xxt_reps):
                for i in np.random.default_rng(r).permutation(len(CLUSTERS)):
                    p = CLUSTERS[i]
                    before = _job_cpu_seconds(clients["tcp"])
                    seconds, check = _run_workload(name, options, clients[p])
                    cpu[p].append(_job_cpu_seconds(clients["tcp"]) - before)
                    times[p].append(seconds)
                    checks[p].append(check)
            first = checks["tcp"][0]
            if not all(dask_workloads.same(first, c) for p in CLUSTERS for c in checks[p]):
                raise RuntimeError(f"{name}: the clusters disagree: {checks}")
            for p in CLUSTERS:
                records.append(
                    {
                        "measurement": name,
                        "transport": p,
                        "size": _sizes_of(name, options),
                        "workers": 1 if p == ONE else 2,
                        "threads_per_worker": 1,
                        "cores": os.cpu_count() or 1,
                        "seconds": report.summarize(times[p]),
                        "cpu_seconds": report.summarize(cpu[p]),
                        "result": first,
                    }
                )
        return records
    finally:
        for c in clients.values():
            c.shutdown()
            c.close()


def measure_workloads(options: Options, world: Any, call: Any) -> list[dict[str, Any]]:
    scheduler, client, _ = options.roles
    rank = world.Get_rank()
    if rank == scheduler:
        asyncio.run(_schedulers(options, world, call))
        return []
    addresses = call(lambda: world.bcast(None, root=scheduler))
    if rank == client:
        return _workloads_client(options, addresses)
    asyncio.run(_workers(options, addresses, rank))
    return []


# --------------------------------------------------------------------------- report
def analyse(records: list[dict[str, Any]]) -> tuple[list[list[Any]], list[list[Any]], list[str]]:
    by = {(r["measurement"], r["transport"], r.get("bytes")): r for r in records}
    ping_rows, verdicts = [], []
    ratios, latency_ratios, ratios_large = [], [], []
    for nbytes in sorted({r["bytes"] for r in records if r["measurement"] == "pingpong"}):
        tcp, mpi = by[("pingpong", "tcp", nbytes)], by[("pingpong", "mpi", nbytes)]
        ratio = mpi["throughput_MBps"]["median"] / tcp["throughput_MBps"]["median"]
        lat_ratio = tcp["latency_us"]["median"] / mpi["latency_us"]["median"]
        mpi["throughput_vs_tcp"], mpi["latency_speedup_vs_tcp"] = ratio, lat_ratio
        ratios.append((ratio, nbytes))
        latency_ratios.append((lat_ratio, nbytes))
        if nbytes >= MIB:
            ratios_large.append((ratio, nbytes))
        ping_rows.append(
            [
                report.format_bytes(nbytes),
                tcp["latency_us"]["median"],
                mpi["latency_us"]["median"],
                lat_ratio,
                tcp["throughput_MBps"]["median"],
                f"{tcp['throughput_MBps']['min']:.0f}-{tcp['throughput_MBps']['max']:.0f}",
                mpi["throughput_MBps"]["median"],
                f"{mpi['throughput_MBps']['min']:.0f}-{mpi['throughput_MBps']['max']:.0f}",
                ratio,
            ]
        )
    for what, found, target in (
        ("latency, every size: tcp:// / mpi:// latency", latency_ratios, TARGET_EVERY_SIZE),
        ("throughput, every size: mpi:// / tcp://", ratios, TARGET_EVERY_SIZE),
        ("throughput, messages >= 1 MiB: mpi:// / tcp://", ratios_large, TARGET_THROUGHPUT),
    ):
        if found:
            low, at = min(found)
            verdicts.append(
                f"{report.verdict(low >= target)} {what} {low:.2f}x at worst ({report.format_bytes(at)}) "
                f"(target >= {target}x)"
            )
    work_rows = []
    for name in WORKLOADS:
        if (name, "tcp", None) not in by:
            continue
        tcp, mpi, one = (by[(name, p, None)] for p in CLUSTERS)
        for r in (mpi, one):
            r["speedup_vs_tcp"] = tcp["seconds"]["median"] / r["seconds"]["median"]
        tcp["speedup_vs_tcp"] = 1.0
        ceiling, why = _ceiling(tcp, one)
        mpi["ceiling_vs_tcp"] = ceiling
        for r in (tcp, mpi, one):
            t, c = r["seconds"], r["cpu_seconds"]["median"]
            work_rows.append(
                [name, r["size"], r["transport"], t["median"], f"{t['min']:.2f}-{t['max']:.2f}", c,
                 c / t["median"], r["speedup_vs_tcp"]]
            )  # fmt: skip
        if name in TARGETS:
            speedup = mpi["speedup_vs_tcp"]
            verdicts.append(
                f"{report.verdict(speedup >= TARGETS[name])} {name}: mpi:// {speedup:.2f}x faster than tcp:// "
                f"(target >= {TARGETS[name]}x), the same result on both; ceiling for any transport here "
                f"{ceiling:.2f} times tcp://'s speed ({why})"
            )
    return ping_rows, work_rows, verdicts


def _ceiling(tcp: dict[str, Any], one: dict[str, Any]) -> tuple[float, str]:
    """The most any transport could speed a workload up over tcp://, and why: two workers take at least half the
    single worker's time (perfect scaling), and at least the CPU the single worker's run needed, spread over every
    core (its run moves nothing between workers: that CPU is the work itself, which two workers must do too)."""
    alone, cpu, cores = one["seconds"]["median"], one["cpu_seconds"]["median"], one["cores"]
    fastest = max(alone / 2, cpu / cores)
    if cpu / cores >= alone / 2:
        why = f"its work takes {cpu:.2f} CPU-s on one worker without network; {cores} cores"
    else:
        why = f"one worker without network takes {alone:.2f} s: at best half that on two"
    return tcp["seconds"]["median"] / fastest, why


PING_HEADERS = [
    "size",
    "tcp latency us",
    "mpi latency us",
    "latency speedup",
    "tcp MB/s",
    "tcp min-max",
    "mpi MB/s",
    "mpi min-max",
    "mpi/tcp throughput",
]
WORK_HEADERS = [
    "workload", "size", "transport", "seconds (median)", "min-max", "CPU s", "cores busy", "speedup vs tcp"
]  # fmt: skip


def write_report(options: Options, records: list[dict[str, Any]], config: dict[str, Any], elapsed: float) -> None:
    ping_rows, work_rows, verdicts = analyse(records)
    where = (
        f"two simulated hosts (network namespaces) with links shaped to {options.link} (tbf): scheduler and one "
        "worker on host a, client and the other worker on host b"
        if options.link
        else "every rank on this machine, tcp:// on loopback"
    )
    header = (
        f"hpdl bench dask: {RANKS} ranks (scheduler, client, 2 workers x 1 thread), OMP_NUM_THREADS=1, "
        f"MPI {config['mpi_library']}, distributed {config['distributed_version']}; {where}; "
        f"{options.reps} ping-pong repetitions, window {options.window}, {options.xxt_reps} repetitions of each "
        "workload"
    )
    notes = [
        "latency = round-trip time / 2 of one Dask message (a NumPy buffer of the size) through distributed.comm.",
        f"throughput = {options.window} messages sent back to back, then one acknowledgement; MB = 1e6 bytes.",
        "workloads: a cluster per transport, and a third with one worker (tcp://, nothing crosses between workers: "
        "the bound), all up at once, alternating; "
        + ("no warm-up (--quick: the first run pays imports and compiled kernels); " if options.quick else "")
        + "the results of every run checked equal across the clusters (integer sums; K-Means' inertia to 1e-9).",
        "CPU s: CPU seconds of the job's 4 processes (every thread) during a run, median; cores busy = CPU s / "
        "seconds. A target line's ceiling: two workers need at least half the single worker's time, and its CPU "
        "seconds spread over every core of the machine.",
        "groupby and merge: dask.dataframe with shuffle_method='p2p'; tasks: dask.delayed calls that sleep.",
        "Clusters alternate in a new random order every repetition; min-max over repetitions.",
    ]
    blocks = ["## Ping-pong", report.markdown_table(PING_HEADERS, ping_rows)]
    if work_rows:
        blocks += ["## Workloads", report.markdown_table(WORK_HEADERS, work_rows, right_align_from=3)]
    text = report.markdown_document("hpdl bench dask", header, blocks, notes, verdicts)
    report.write_report(options.out, f"dask-{options.link}" if options.link else "dask", text, records, config, elapsed)


def main(argv: Optional[list[str]] = None) -> int:
    """`launch` by default; with --worker, `worker` (every rank)."""
    return report.run_main(argv, parse, launch, worker)


def worker(options: Options) -> int:
    """The worker (every rank): ping-pong between the worker ranks, then two clusters at once; the client reports."""
    import logging

    import distributed
    from mpi4py import MPI

    import hpdl.dask.transport  # noqa: F401 - registers mpi://
    from hpdl.dask.connection import get_hub

    logging.getLogger("distributed").setLevel(logging.WARNING)
    started = time.perf_counter()
    world = MPI.COMM_WORLD
    if world.Get_size() != RANKS:
        raise SystemExit(f"hpdl bench dask: needs exactly {RANKS} ranks, got {world.Get_size()}")
    call = get_hub().progress.call
    mine = measure_pingpong(options, world, call)
    merged = [r for part in call(lambda: world.allgather(mine), timeout=options.timeout) for r in part]
    if options.workloads:
        merged += measure_workloads(options, world, call)
    if world.Get_rank() == options.roles[1]:
        config = report.environment(
            benchmark="dask",
            quick=options.quick,
            world_ranks=RANKS,
            mpi_library=MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip(),
            distributed_version=distributed.__version__,
            window=options.window,
            sizes=list(options.sizes),
            link=options.link or None,
            workloads=list(options.workloads),
            rows=options.work.rows,
            tasks=options.work.tasks,
            points=options.work.points,
        )
        write_report(options, merged, config, time.perf_counter() - started)
    _quiet_barrier(world, call, options.timeout)  # leave together: nobody finalises MPI while a peer still shuts down
    return 0


if __name__ == "__main__":
    sys.exit(main())
