"""`hpdl bench dask`: Dask's tcp:// beside hpdl's mpi:// on this machine, in one launch of 4 ranks.

Two measurements, each alternating the transports (a new random order every
repetition) on the same ranks and data:

    ping-pong   ranks 2 and 3 hold one comm of each transport (distributed.comm.connect/listen, the layer the
                scheduler and workers use): round-trip time of one message (a NumPy buffer, 1 B .. 64 MiB);
                latency = RTT / 2; throughput = `window` messages sent back to back, then an acknowledgement.
    x + x.T     two Dask clusters at once, one per transport (scheduler on rank 0, the client on rank 1, one
                worker of each cluster on ranks 2 and 3, 1 thread each): wall time of (x + x.T).sum() for
                x = da.random.RandomState(0).random_sample((n, n), chunks=c) (20,000 / 2,000 by default);
                both clusters must return the same sum.

Start it with `hpdl bench dask [--quick]` (this module's `launch`), which runs
`mpiexec -n 4 python -m hpdl.bench.dask_transport --worker ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from hpdl.bench import report
from hpdl.bench.comm import _positive

__all__ = ["launch", "main"]

PROTOCOLS = ("tcp", "mpi")
LISTEN = {"tcp": "tcp://127.0.0.1", "mpi": "mpi://"}
RANKS = 4
MIB = 1 << 20
SIZES = (1, 1 << 10, 64 << 10, MIB, 8 * MIB, 64 * MIB)
QUICK_SIZES = (1, 64 << 10, MIB)
TARGET_THROUGHPUT = 1.5
"""mpi:// / tcp:// throughput for messages >= 1 MiB."""
TARGET_XXT = 1.2
"""tcp:// / mpi:// wall time of the x + x.T sum."""


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
    timeout: float = 1800.0
    worker: bool = False

    def forwarded(self) -> list[str]:
        args = ["--worker", "--out", os.path.abspath(self.out), "--reps", str(self.reps), "--window", str(self.window)]
        args += ["--n", str(self.n), "--chunk", str(self.chunk), "--xxt-reps", str(self.xxt_reps)]
        args += ["--sizes", *(str(s) for s in self.sizes)]
        return args + (["--quick"] if self.quick else [])


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
    parser.add_argument("--xxt-reps", type=_positive(int), help="x + x.T repetitions per transport (default 5)")
    parser.add_argument("--timeout", type=_positive(float), default=1800.0, help="stop the job after this many s")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def parse(argv: Sequence[str]) -> Options:
    ns = build_parser().parse_args(list(argv))
    quick = bool(ns.quick)
    return Options(
        quick=quick,
        out=ns.out,
        sizes=tuple(ns.sizes or (QUICK_SIZES if quick else SIZES)),
        reps=ns.reps or (2 if quick else 10),
        window=ns.window if not quick else min(ns.window, 4),
        n=ns.n or (1_000 if quick else 20_000),
        chunk=ns.chunk or (250 if quick else 2_000),
        xxt_reps=ns.xxt_reps or (2 if quick else 5),
        timeout=ns.timeout,
        worker=bool(ns.worker),
    )


def launch(argv: list[str]) -> int:
    """Start the benchmark on 4 ranks (mpiexec beside this Python) and return its exit code."""
    return report.launch_benchmark("hpdl bench dask", "hpdl.bench.dask_transport", parse, argv, ranks=RANKS)


# --------------------------------------------------------------------------- MPI helpers that keep mpi:// serving
def _quiet_barrier(world: Any, call: Any, timeout: float) -> None:
    """A barrier that sleeps while it waits (a spinning MPI_Barrier would steal the measured ranks' cores).

    Waits here, not on the progress thread (which keeps serving mpi:// meanwhile), and gives up after `timeout`
    seconds: a dead or stuck rank ends the job with an error instead of blocking the transport forever."""
    request = call(world.Ibarrier)
    deadline = time.monotonic() + timeout
    while not call(request.Test):
        if time.monotonic() > deadline:
            raise TimeoutError(f"hpdl bench dask: a rank is still busy after {timeout:g} s at a barrier")
        time.sleep(1e-3)


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


def measure_pingpong(options: Options, world: Any, call: Any) -> list[dict[str, Any]]:
    """Ranks 2 (serves) and 3 (measures); ranks 0 and 1 wait in a sleeping barrier."""
    from distributed.comm import listen

    rank = world.Get_rank()
    records: list[dict[str, Any]] = []

    async def server() -> None:
        from hpdl.dask.connection import get_hub

        listeners = {p: await listen(LISTEN[p], _serve) for p in PROTOCOLS}
        addresses = {p: listener.contact_address for p, listener in listeners.items()}
        await get_hub().wait_request(lambda: world.isend(addresses, dest=3, tag=11))
        await get_hub().wait_request(lambda: world.irecv(source=3, tag=12))  # the client is done
        for listener in listeners.values():
            listener.stop()

    async def client() -> None:
        loop = asyncio.get_running_loop()
        addresses = await loop.run_in_executor(None, call, lambda: world.recv(source=2, tag=11))
        records.extend(await _pingpong_client(options, addresses))
        await loop.run_in_executor(None, call, lambda: world.send("done", dest=2, tag=12))

    if rank == 2:
        asyncio.run(server())
    elif rank == 3:
        asyncio.run(client())
    _quiet_barrier(world, call, options.timeout)
    return records


# --------------------------------------------------------------------------- x + x.T on two clusters at once
async def _schedulers(world: Any, call: Any) -> None:
    from distributed import Scheduler

    async with (
        Scheduler(protocol="tcp", dashboard_address=":0") as tcp,
        Scheduler(protocol="mpi", dashboard_address=":0") as mpi,
    ):
        addresses = {"tcp": tcp.address, "mpi": mpi.address}
        await asyncio.get_running_loop().run_in_executor(None, call, lambda: world.bcast(addresses, root=0))
        await asyncio.gather(tcp.finished(), mpi.finished())


async def _workers(addresses: dict[str, str], rank: int) -> None:
    from distributed import Worker

    async with (
        Worker(
            addresses["tcp"], protocol="tcp", nthreads=1, name=f"tcp-{rank}", dashboard=False, death_timeout=300
        ) as a,
        Worker(
            addresses["mpi"], protocol="mpi", nthreads=1, name=f"mpi-{rank}", dashboard=False, death_timeout=300
        ) as b,
    ):
        await asyncio.gather(a.finished(), b.finished())


def _xxt_client(options: Options, addresses: dict[str, str]) -> list[dict[str, Any]]:
    import dask.array as da
    from distributed import Client

    clients = {p: Client(addresses[p], timeout=120) for p in PROTOCOLS}
    try:
        for c in clients.values():
            c.wait_for_workers(2, timeout=120)
        x = da.random.RandomState(0).random_sample((options.n, options.n), chunks=options.chunk)
        expr = (x + x.T).sum()
        times: dict[str, list[float]] = {p: [] for p in PROTOCOLS}
        sums: dict[str, list[float]] = {p: [] for p in PROTOCOLS}
        for p in PROTOCOLS:  # warm up (imports and connections on the workers)
            sums[p].append(float(clients[p].compute(expr).result()))
        for r in range(options.xxt_reps):
            for i in np.random.default_rng(r).permutation(len(PROTOCOLS)):
                p = PROTOCOLS[i]
                start = time.perf_counter()
                sums[p].append(float(clients[p].compute(expr).result()))
                times[p].append(time.perf_counter() - start)
        every = [s for p in PROTOCOLS for s in sums[p]]
        if max(every) - min(every) > 1e-9 * abs(every[0]):
            raise RuntimeError(f"x + x.T: the clusters disagree: {sums}")
        return [
            {
                "measurement": "x+x.T",
                "transport": p,
                "n": options.n,
                "chunk": options.chunk,
                "workers": 2,
                "threads_per_worker": 1,
                "seconds": report.summarize(times[p]),
                "result": sums[p][0],
            }
            for p in PROTOCOLS
        ]
    finally:
        for c in clients.values():
            c.shutdown()
            c.close()


def measure_xxt(options: Options, world: Any, call: Any) -> list[dict[str, Any]]:
    rank = world.Get_rank()
    if rank == 0:
        asyncio.run(_schedulers(world, call))
        return []
    addresses = call(lambda: world.bcast(None, root=0))
    if rank == 1:
        return _xxt_client(options, addresses)
    asyncio.run(_workers(addresses, rank))
    return []


# --------------------------------------------------------------------------- report
def analyse(records: list[dict[str, Any]]) -> tuple[list[list[Any]], list[list[Any]], list[str]]:
    by = {(r["measurement"], r["transport"], r.get("bytes")): r for r in records}
    ping_rows, verdicts = [], []
    ratios_large = []
    for nbytes in sorted({r["bytes"] for r in records if r["measurement"] == "pingpong"}):
        tcp, mpi = by[("pingpong", "tcp", nbytes)], by[("pingpong", "mpi", nbytes)]
        ratio = mpi["throughput_MBps"]["median"] / tcp["throughput_MBps"]["median"]
        lat_ratio = tcp["latency_us"]["median"] / mpi["latency_us"]["median"]
        mpi["throughput_vs_tcp"], mpi["latency_speedup_vs_tcp"] = ratio, lat_ratio
        if nbytes >= MIB:
            ratios_large.append(ratio)
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
    if ratios_large:
        low = min(ratios_large)
        verdicts.append(
            f"{report.verdict(low >= TARGET_THROUGHPUT)} throughput, messages >= 1 MiB: mpi:// "
            f"{low:.2f}x tcp:// at worst (target >= {TARGET_THROUGHPUT}x)"
        )
    xxt_rows = []
    if ("x+x.T", "tcp", None) in by:
        tcp, mpi = by[("x+x.T", "tcp", None)], by[("x+x.T", "mpi", None)]
        speedup = tcp["seconds"]["median"] / mpi["seconds"]["median"]
        mpi["speedup_vs_tcp"] = speedup
        for r in (tcp, mpi):
            s = r["seconds"]
            xxt_rows.append(
                [r["transport"], f"{r['n']} / {r['chunk']}", s["median"], f"{s['min']:.2f}-{s['max']:.2f}", r["result"]]
            )
        xxt_rows[-1].append(speedup)
        xxt_rows[0].append(1.0)
        verdicts.append(
            f"{report.verdict(speedup >= TARGET_XXT)} x + x.T: mpi:// {speedup:.2f}x faster than tcp:// "
            f"(target >= {TARGET_XXT}x), same sum: {tcp['result'] == mpi['result']}"
        )
    return ping_rows, xxt_rows, verdicts


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
XXT_HEADERS = ["transport", "n / chunk", "seconds (median)", "min-max", "sum", "speedup vs tcp"]


def write_report(options: Options, records: list[dict[str, Any]], config: dict[str, Any], elapsed: float) -> None:
    ping_rows, xxt_rows, verdicts = analyse(records)
    header = (
        f"hpdl bench dask: {RANKS} ranks (scheduler, client, 2 workers x 1 thread), OMP_NUM_THREADS=1, "
        f"MPI {config['mpi_library']}, distributed {config['distributed_version']}, loopback; "
        f"{options.reps} ping-pong repetitions, window {options.window}, {options.xxt_reps} x + x.T repetitions"
    )
    notes = [
        "latency = round-trip time / 2 of one Dask message (a NumPy buffer of the size) through distributed.comm.",
        f"throughput = {options.window} messages sent back to back, then one acknowledgement; MB = 1e6 bytes.",
        "x + x.T: (x + x.T).sum() on a cluster per transport; both run at once, alternating; warm-up excluded.",
        "Transports alternate in a new random order every repetition; min-max over repetitions.",
    ]
    ping = report.markdown_table(PING_HEADERS, ping_rows)
    blocks = ["## Ping-pong", ping, "## x + x.T", report.markdown_table(XXT_HEADERS, xxt_rows)]
    text = report.markdown_document("hpdl bench dask", header, blocks, notes, verdicts)
    report.write_report(options.out, "dask", text, records, config, elapsed)


def main(argv: Optional[list[str]] = None) -> int:
    """`launch` by default; with --worker, `worker` (every rank)."""
    return report.run_main(argv, parse, launch, worker)


def worker(options: Options) -> int:
    """The worker (every rank): ping-pong on ranks 2-3, then two clusters at once, report on rank 1."""
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
    merged += measure_xxt(options, world, call)
    if world.Get_rank() == 1:
        config = report.environment(
            benchmark="dask",
            quick=options.quick,
            world_ranks=RANKS,
            mpi_library=MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip(),
            distributed_version=distributed.__version__,
            window=options.window,
            sizes=list(options.sizes),
        )
        write_report(options, merged, config, time.perf_counter() - started)
    _quiet_barrier(world, call, options.timeout)  # leave together: nobody finalises MPI while a peer still shuts down
    return 0


if __name__ == "__main__":
    sys.exit(main())
