"""`hpdl bench comm`: OSU-style latency and bandwidth of hpdl's collectives beside the raw engines.

The columns share one launch and one schedule and alternate per
repetition, in a new (seeded) order each time, so that drift on a shared
machine and the cost of switching engines hit them alike:

    hpdl-mpi           hpdl.init("mpi")   communicator (mpi4py underneath) on ordinary tensors
    hpdl-mpi-shm       the same on tensors from comm.shared_buffer (zero copy into shared memory)
    hpdl-torch         hpdl.init("torch") communicator (gloo underneath)
    mpi4py             raw MPI.COMM_WORLD calls on NumPy arrays (same memory)
    torch.distributed  raw torch.distributed calls on gloo

It also measures tensor fusion (200 x 4 KiB tensors), the cost of debug
mode, and a single-process memory copy as a ceiling for the allreduce.

Run it with `hpdl bench comm [-n 2] [--quick]` (this module's `launch`),
which starts `mpiexec -n N python -m hpdl.bench.comm --worker ...`.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

import hpdl.settings as settings
from hpdl.bench import report
from hpdl.bench.arguments import positive

__all__ = ["launch", "main", "COLUMNS", "OPS", "SHM_OPS"]

from hpdl.bench.comm_report import (
    debug_table,
    fusion_table,
    header_lines,
    loop_table,
    op_tables,
    plot,
    root_table,
    targets,
)
from hpdl.bench.comm_spec import (
    COLUMNS,
    COPY_FROM,
    DEBUG_SIZES,
    DEFAULT_SIZES,
    FUSION_BYTES,
    FUSION_TENSORS,
    GLOO_PREFIXES,
    ITEMSIZE,
    LOOP_CALLS,
    LOOP_UP_TO,
    MIB,
    OPS,
    QUICK_SIZES,
    ROOT_CALLS,
    ROOT_UP_TO,
    SEPARATE_TENSORS,
    SHM_OPS,
    SIZE_MEANING,
    TIMING,
)


# --------------------------------------------------------------------------- options
@dataclass(frozen=True)
class Options:
    """What one run measures; every field is printed in the header and stored in each JSON record."""

    ranks: int = 2
    """MPI processes (`-n`); send/recv uses ranks 0 and 1."""
    quick: bool = False
    """A few sizes up to 1 MiB and few repetitions: a smoke test of this code, not a measurement."""
    out: str = "bench-results/comm"
    """Folder for comm.json, comm.md and comm.png."""
    sizes: tuple[int, ...] = DEFAULT_SIZES
    """Message sizes in bytes (multiples of 4: float32)."""
    iters: int = 200
    """Most timed repetitions per column and size (small messages reach it)."""
    min_iters: int = 7
    """Fewest timed repetitions per column and size (large messages, bounded by `budget`)."""
    warmup: int = 5
    """Untimed calls per column before timing (2 for sizes of 1 MiB and more)."""
    budget: float = 1.5
    """Seconds of timed repetitions per (operation, size), all columns together."""
    timeout: float = 1800.0
    """Seconds before `launch` stops the whole job."""
    worker: bool = False

    def forwarded(self) -> list[str]:
        """The worker's arguments: explicit values, so every rank runs the same configuration."""
        args = ["--worker", "--out", os.path.abspath(self.out), "--iters", str(self.iters)]
        args += ["--budget", str(self.budget), "--sizes", *map(str, self.sizes)]
        return args + (["--quick"] if self.quick else [])


def _size(text: str) -> int:
    try:
        value = report.parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value % ITEMSIZE:
        raise argparse.ArgumentTypeError(f"size {text!r} = {value} B is not a multiple of {ITEMSIZE} B (float32)")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpdl bench comm",
        description="Latency and bandwidth of hpdl-mpi and hpdl-torch beside raw mpi4py and torch.distributed "
        "(gloo), alternating per repetition in one launch.",
    )
    parser.add_argument("-n", "--ranks", type=positive(int), default=2, help="MPI processes (default 2)")
    parser.add_argument("--quick", action="store_true", help="a few sizes up to 1 MiB, few repetitions (seconds)")
    parser.add_argument("--out", default="bench-results/comm", help="output folder (default bench-results/comm)")
    parser.add_argument("--sizes", nargs="+", type=_size, help="message sizes, e.g. 4 64K 1M (default 4 B .. 64 MiB)")
    parser.add_argument("--iters", type=positive(int), help="most timed repetitions per column and size")
    parser.add_argument("--budget", type=positive(float), help="seconds of timing per (operation, size)")
    parser.add_argument("--timeout", type=positive(float), default=1800.0, help="stop the job after this many s")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def parse(argv: Sequence[str]) -> Options:
    parser = build_parser()
    ns = parser.parse_args(list(argv))
    quick = bool(ns.quick)
    sizes = tuple(sorted(set(ns.sizes))) if ns.sizes else (QUICK_SIZES if quick else DEFAULT_SIZES)
    if ns.ranks < 2:
        parser.error(f"-n {ns.ranks}: the benchmark needs at least 2 ranks (send/recv pairs ranks 0 and 1)")
    return Options(
        ranks=ns.ranks,
        quick=quick,
        out=ns.out,
        sizes=sizes,
        iters=ns.iters or (10 if quick else 200),
        min_iters=3 if quick else 7,
        warmup=2 if quick else 5,
        budget=ns.budget or (0.25 if quick else 1.5),
        timeout=ns.timeout,
        worker=bool(ns.worker),
    )


# --------------------------------------------------------------------------- launcher
def launch(argv: list[str]) -> int:
    """Start the benchmark on its ranks (mpiexec beside this Python) and return its exit code."""
    return report.launch_benchmark("hpdl bench comm", "hpdl.bench.comm", parse, argv)


run_worker = report.run_worker  # it lives in report (below this module); the benchmarks still import it here


# --------------------------------------------------------------------------- timing
Column = Callable[[], Any]


@dataclass
class Case:
    """One (operation, size): the columns to alternate, and how to check that each computes the right thing."""

    columns: dict[str, Column]
    fill: Callable[[], Any]
    """Put the check pattern into the inputs."""
    correct: Callable[[Any], bool]
    """Whether a column's return value (or the in-place buffer) holds the expected result on this rank."""
    clear: Callable[[], Any]
    """Zero the inputs, so that repeated reductions neither overflow nor change the arithmetic."""


@dataclass
class Bench:
    """The communicators, the raw engines, and the repetition rule of one run."""

    options: Options
    mpi: Any
    gloo: Any
    world: Any = field(init=False)
    dist: Any = field(init=False)
    MPI: Any = field(init=False)
    all_gather: Any = field(init=False)
    reduce_scatter: Any = field(init=False)
    load_at_start: float = field(init=False)

    def __post_init__(self) -> None:
        import torch.distributed as dist
        from mpi4py import MPI

        self.MPI = MPI
        self.world = MPI.COMM_WORLD
        self.dist = dist
        # torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names warn);
        # use what hpdl's torch backend uses, so that the raw column is the same engine call.
        self.all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self.load_at_start = os.getloadavg()[0]

    @property
    def rank(self) -> int:
        return int(self.mpi.rank)

    @property
    def size(self) -> int:
        return int(self.mpi.size)

    def check(self, name: str, case: Case) -> None:
        """Run each column once on the check pattern; a wrong result stops the job (speed without accuracy is void)."""
        for column, fn in case.columns.items():
            case.fill()
            self.world.Barrier()
            result = fn()
            ok = case.correct(result)
            verdict = self.world.allreduce(int(not ok), op=self.MPI.SUM)
            if verdict:
                raise RuntimeError(f"{name}: column {column} computed a wrong result on {verdict} rank(s)")
        case.clear()

    def barrier_for(self, column: str) -> Callable[[], Any]:
        """The column's own engine's barrier: a spinning MPI_Barrier before a gloo call starves gloo's threads."""
        return self.dist.barrier if column.startswith(GLOO_PREFIXES) else self.world.Barrier

    def alternate(
        self, columns: Mapping[str, Column], *, warmup: int, reduce: str = "max", budget: Optional[float] = None
    ) -> tuple[dict[str, list[float]], int]:
        """Alternate the columns per repetition and return each column's seconds per repetition, and the count.

        The count comes from the slowest rank's last warm-up round (barriers
        included): as many repetitions as fit `budget`, between `min_iters`
        and `iters`. Every rank derives the same count from the same
        max-reduced estimate, so the ranks stay in step.
        """
        names = list(columns)
        fns = [columns[n] for n in names]
        syncs = [self.barrier_for(n) for n in names]
        round_time = np.zeros(1)
        for _ in range(max(1, warmup)):
            round_start = perf_counter()
            for sync, fn in zip(syncs, fns):
                sync()
                fn()
            round_time[0] = perf_counter() - round_start
        self.world.Allreduce(self.MPI.IN_PLACE, round_time, op=self.MPI.MAX)
        limit = self.options.budget if budget is None else budget
        reps = int(min(self.options.iters, max(self.options.min_iters, limit // float(round_time[0]))))
        times = np.zeros((len(fns), reps))
        for r in range(reps):
            # A new order every repetition, the same on every rank (seeded by the repetition): the
            # first call after a switch of engines pays for it, and with a fixed order (or a
            # rotation, which keeps neighbours) the same column would always be the one that pays.
            for i in np.random.default_rng(r).permutation(len(fns)):
                syncs[i]()
                start = perf_counter()
                fns[i]()
                times[i, r] = perf_counter() - start
        if reduce == "max":
            self.world.Allreduce(self.MPI.IN_PLACE, times, op=self.MPI.MAX)
        else:  # rank 0's clock (ping-pong, single-process copy)
            self.world.Bcast(times, root=0)
        return {n: times[i].tolist() for i, n in enumerate(names)}, reps

    def warmup_for(self, nbytes: int) -> int:
        """Untimed calls per column: large messages need few to fault their pages in and pick their protocol."""
        return min(2, self.options.warmup) if nbytes >= MIB else self.options.warmup


# --------------------------------------------------------------------------- the cases
def allreduce_case(b: Bench, nbytes: int) -> Case:
    import torch

    # MPI and gloo columns get tensor objects of their own (see SEPARATE_TENSORS).
    buf, gbuf = torch.zeros(nbytes // ITEMSIZE), torch.zeros(nbytes // ITEMSIZE)
    shared = b.mpi.shared_buffer(nbytes // ITEMSIZE)  # collective: every rank builds the same cases
    arr = buf.numpy()
    p = b.size

    def raw_mpi() -> Any:
        b.world.Allreduce(b.MPI.IN_PLACE, arr, op=b.MPI.SUM)
        return buf

    def raw_torch() -> Any:
        b.dist.all_reduce(gbuf)
        return gbuf

    return Case(
        columns={
            "hpdl-mpi": lambda: b.mpi.allreduce(buf),
            "hpdl-mpi-shm": lambda: b.mpi.allreduce(shared),
            "hpdl-torch": lambda: b.gloo.allreduce(gbuf),
            "mpi4py": raw_mpi,
            "torch.distributed": raw_torch,
        },
        fill=lambda: [t.fill_(b.rank + 1) for t in (buf, gbuf, shared)],
        correct=lambda result: bool((torch.as_tensor(result) == p * (p + 1) / 2).all()),
        clear=lambda: [t.zero_() for t in (buf, gbuf, shared)],
    )


def allgather_case(b: Bench, nbytes: int) -> Case:
    import torch

    n, p = nbytes // ITEMSIZE, b.size
    inp, out = torch.zeros(n), torch.zeros(n * p)
    ginp, gout = torch.zeros(n), torch.zeros(n * p)
    shared = b.mpi.shared_buffer(n)
    inp_arr, out_arr = inp.numpy(), out.numpy()
    sizes = [n] * p
    expected = torch.arange(1, p + 1, dtype=torch.float32).repeat_interleave(n)

    def raw_mpi() -> Any:
        b.world.Allgather(inp_arr, out_arr)
        return out

    def raw_torch() -> Any:
        b.all_gather(gout, ginp)
        return gout

    def fill() -> None:
        for t in (inp, ginp, shared):
            t.fill_(b.rank + 1)
        out.zero_()
        gout.zero_()

    return Case(
        columns={
            # Every column writes into the same preallocated output (as the raw calls must).
            "hpdl-mpi": lambda: b.mpi.allgather(inp, sizes=sizes, out=out),
            "hpdl-mpi-shm": lambda: b.mpi.allgather(shared, sizes=sizes, out=out),
            "hpdl-torch": lambda: b.gloo.allgather(ginp, sizes=sizes, out=gout),
            "mpi4py": raw_mpi,
            "torch.distributed": raw_torch,
        },
        fill=fill,
        correct=lambda result: bool(torch.equal(torch.as_tensor(result), expected)),
        clear=lambda: [t.zero_() for t in (inp, out, ginp, gout, shared)],
    )


def reduce_scatter_case(b: Bench, nbytes: int) -> Case:
    import torch

    n, p = nbytes // ITEMSIZE, b.size
    inp, out = torch.zeros(n * p), torch.zeros(n)
    ginp, gout = torch.zeros(n * p), torch.zeros(n)
    shared = b.mpi.shared_buffer(n * p)
    inp_arr, out_arr = inp.numpy(), out.numpy()
    # Block j of rank q holds (q + 1) + 10 j, so rank r must end with sum_q (q + 1) + 10 r p: right sum, right block.
    want = p * (p + 1) / 2 + 10 * b.rank * p

    def raw_mpi() -> Any:
        b.world.Reduce_scatter_block(inp_arr, out_arr, op=b.MPI.SUM)
        return out

    def raw_torch() -> Any:
        b.reduce_scatter(gout, ginp)
        return gout

    def fill() -> None:
        inp.view(p, n).copy_((b.rank + 1 + 10 * torch.arange(p, dtype=torch.float32)).unsqueeze(1).expand(p, n))
        shared.copy_(inp)
        ginp.copy_(inp)
        out.zero_()
        gout.zero_()

    return Case(
        columns={
            "hpdl-mpi": lambda: b.mpi.reduce_scatter(inp, out=out),
            "hpdl-mpi-shm": lambda: b.mpi.reduce_scatter(shared, out=out),
            "hpdl-torch": lambda: b.gloo.reduce_scatter(ginp, out=gout),
            "mpi4py": raw_mpi,
            "torch.distributed": raw_torch,
        },
        fill=fill,
        correct=lambda result: bool((torch.as_tensor(result) == want).all()),
        clear=lambda: [t.zero_() for t in (inp, out, ginp, gout, shared)],
    )


def broadcast_case(b: Bench, nbytes: int) -> Case:
    import torch

    buf, gbuf = torch.zeros(nbytes // ITEMSIZE), torch.zeros(nbytes // ITEMSIZE)
    arr = buf.numpy()

    def raw_mpi() -> Any:
        b.world.Bcast(arr, root=0)
        return buf

    def raw_torch() -> Any:
        b.dist.broadcast(gbuf, 0)
        return gbuf

    return Case(
        columns={
            "hpdl-mpi": lambda: b.mpi.broadcast(buf, 0),
            "hpdl-torch": lambda: b.gloo.broadcast(gbuf, 0),
            "mpi4py": raw_mpi,
            "torch.distributed": raw_torch,
        },
        fill=lambda: [t.fill_(7.0 if b.rank == 0 else 0.0) for t in (buf, gbuf)],
        correct=lambda result: bool((torch.as_tensor(result) == 7.0).all()),
        clear=lambda: [t.zero_() for t in (buf, gbuf)],
    )


def sendrecv_case(b: Bench, nbytes: int) -> Case:
    """Ping-pong between ranks 0 and 1 (rank 0 sends first); other ranks only take part in the barriers."""
    import torch

    buf, gbuf = torch.zeros(nbytes // ITEMSIZE), torch.zeros(nbytes // ITEMSIZE)
    arr = buf.numpy()
    rank = b.rank

    def pingpong(held: Any, send: Callable[[int], Any], recv: Callable[[int], Any]) -> Column:
        def run() -> Any:
            if rank == 0:
                send(1)
                recv(1)
            elif rank == 1:
                recv(0)
                send(0)
            return held

        return run

    return Case(
        columns={
            "hpdl-mpi": pingpong(buf, lambda d: b.mpi.send(buf, d), lambda s: b.mpi.recv(buf, s)),
            "hpdl-torch": pingpong(gbuf, lambda d: b.gloo.send(gbuf, d), lambda s: b.gloo.recv(gbuf, s)),
            "mpi4py": pingpong(buf, lambda d: b.world.Send(arr, dest=d), lambda s: b.world.Recv(arr, source=s)),
            "torch.distributed": pingpong(gbuf, lambda d: b.dist.send(gbuf, d), lambda s: b.dist.recv(gbuf, s)),
        },
        fill=lambda: [t.fill_(5.0 if rank == 0 else 0.0) for t in (buf, gbuf)],
        correct=lambda result: rank > 1 or bool((torch.as_tensor(result) == 5.0).all()),
        clear=lambda: [t.zero_() for t in (buf, gbuf)],
    )


CASES: dict[str, Callable[[Bench, int], Case]] = {
    "allreduce": allreduce_case,
    "allgather": allgather_case,
    "reduce_scatter": reduce_scatter_case,
    "broadcast": broadcast_case,
    "sendrecv": sendrecv_case,
}


# --------------------------------------------------------------------------- measurements
def measure_ops(b: Bench) -> list[dict[str, Any]]:
    """The OSU-style grid: every operation at every size, the four columns alternating."""
    records = []
    for op in OPS:
        for nbytes in b.options.sizes:
            case = CASES[op](b, nbytes)
            b.check(f"{op} {report.format_bytes(nbytes)}", case)
            warmup = b.warmup_for(nbytes)
            pingpong = op == "sendrecv"
            samples, reps = b.alternate(case.columns, warmup=warmup, reduce="rank0" if pingpong else "max")
            for column, seconds in samples.items():
                if pingpong:
                    seconds = [s / 2 for s in seconds]
                records.append(_record("latency", op, column, nbytes, seconds, reps, warmup, b, pingpong=pingpong))
            del case
    return records


def measure_loops(b: Bench) -> list[dict[str, Any]]:
    """hpdl-mpi and mpi4py in back-to-back calls (OSU-style: one barrier, then `LOOP_CALLS` calls), for messages
    up to `LOOP_UP_TO`: the cost of a call itself, without the barrier's exit skew that one call per repetition
    carries (which, on a shared VM, moves medians by tens of percent between runs)."""
    records = []
    calls = 10 if b.options.quick else LOOP_CALLS
    for op in OPS:
        for nbytes in [n for n in b.options.sizes if n <= LOOP_UP_TO]:
            case = CASES[op](b, nbytes)
            columns = {name: _repeated(case.columns[name], calls) for name in ("hpdl-mpi", "mpi4py")}
            pingpong = op == "sendrecv"
            samples, reps = b.alternate(columns, warmup=1, reduce="rank0" if pingpong else "max")
            for column, seconds in samples.items():
                per_call = [s / calls / (2 if pingpong else 1) for s in seconds]
                records.append(_record("loop", op, column, nbytes, per_call, reps, 1, b, pingpong=pingpong))
    return records


def measure_root(b: Bench) -> list[dict[str, Any]]:
    """hpdl-mpi's and mpi4py's broadcast from rank 0, `ROOT_CALLS` back to back per repetition, timed on the root
    alone (the columns alternate per repetition, as everywhere): what a call costs the rank that sends."""
    records = []
    calls = 10 if b.options.quick else ROOT_CALLS
    for nbytes in [n for n in b.options.sizes if n <= ROOT_UP_TO]:
        case = broadcast_case(b, nbytes)
        columns = {name: _repeated(case.columns[name], calls) for name in ("hpdl-mpi", "mpi4py")}
        samples, reps = b.alternate(columns, warmup=1, reduce="rank0")
        for column, seconds in samples.items():
            per_call = [s / calls for s in seconds]
            records.append(_record("root", "broadcast", column, nbytes, per_call, reps, 1, b))
    return records


def _repeated(call: Column, times: int) -> Column:
    def run() -> None:
        for _ in range(times):
            call()

    return run


def measure_copy(b: Bench) -> list[dict[str, Any]]:
    """`dst.copy_(src)` of the same bytes in one process: a ceiling no allreduce of those bytes can beat."""
    import torch

    records = []
    for nbytes in [s for s in b.options.sizes if s >= COPY_FROM]:
        src, dst = torch.ones(nbytes // ITEMSIZE), torch.empty(nbytes // ITEMSIZE)

        def copy(src: Any = src, dst: Any = dst) -> None:
            if b.rank == 0:
                dst.copy_(src)

        warmup = b.warmup_for(nbytes)
        samples, reps = b.alternate({"memory copy": copy}, warmup=warmup, reduce="rank0", budget=b.options.budget / 4)
        records.append(_record("copy", "copy", "memory copy", nbytes, samples["memory copy"], reps, warmup, b))
    return records


def measure_fusion(b: Bench) -> list[dict[str, Any]]:
    """200 x 4 KiB through one `allreduce_coalesced` vs 200 `allreduce` calls; raw mpi4py as the floor."""
    import torch

    count, n = FUSION_TENSORS, FUSION_BYTES // ITEMSIZE
    tensors = [torch.zeros(n) for _ in range(count)]
    gtensors = [torch.zeros(n) for _ in range(count)]  # SEPARATE_TENSORS
    arrays = [t.numpy() for t in tensors]
    flat, gflat = torch.zeros(count * n), torch.zeros(count * n)
    flat_arr = flat.numpy()

    def separate(comm: Any, held: list) -> Column:
        def run() -> None:
            for t in held:
                comm.allreduce(t)

        return run

    def raw_separate() -> None:
        for a in arrays:
            b.world.Allreduce(b.MPI.IN_PLACE, a, op=b.MPI.SUM)

    def gloo_separate() -> None:
        for t in gtensors:
            b.dist.all_reduce(t)

    # The raw peers bound what fusion can reach: one engine call on the packed bytes (no pack/unpack copies),
    # and the per-call cost that 200 separate raw calls pay.
    columns: dict[str, Column] = {
        "hpdl-mpi coalesced": lambda: b.mpi.allreduce_coalesced(tensors),
        "hpdl-mpi separate": separate(b.mpi, tensors),
        "hpdl-torch coalesced": lambda: b.gloo.allreduce_coalesced(gtensors),
        "hpdl-torch separate": separate(b.gloo, gtensors),
        "mpi4py one flat call": lambda: b.world.Allreduce(b.MPI.IN_PLACE, flat_arr, op=b.MPI.SUM),
        "mpi4py separate": raw_separate,
        "torch.distributed one flat call": lambda: b.dist.all_reduce(gflat),
        "torch.distributed separate": gloo_separate,
    }
    p = b.size
    for name, held in (("hpdl-mpi coalesced", tensors), ("hpdl-torch coalesced", gtensors)):
        for t in held:
            t.fill_(b.rank + 1)
        b.world.Barrier()
        columns[name]()
        if not all(bool((t == p * (p + 1) / 2).all()) for t in held):
            raise RuntimeError(f"fusion: {name} computed a wrong result on rank {b.rank}")
    for t in tensors + gtensors:
        t.zero_()
    warmup = b.options.warmup
    # 200 separate gloo calls take ~0.2 s a round, 300-1000x the rest: alternated among themselves, so that the
    # other columns get enough repetitions for a median (in one alternation with them: 7)
    slow = {name: columns.pop(name) for name in ("hpdl-torch separate", "torch.distributed separate")}
    records = []
    for group, budget in ((columns, 2 * b.options.budget), (slow, b.options.budget)):
        samples, reps = b.alternate(group, warmup=warmup, budget=budget)
        records += [
            _record("fusion", "allreduce x200", column, count * FUSION_BYTES, seconds, reps, warmup, b)
            for column, seconds in samples.items()
        ]
    return records


def measure_debug(b: Bench) -> list[dict[str, Any]]:
    """hpdl-mpi allreduce with `comm.debug` off and on (the fingerprint allgather before each call), and with the
    agreement check (every `check_every` calls, on by default) switched off, to show what it costs."""
    import torch

    records = []
    for nbytes in DEBUG_SIZES:
        buf = torch.zeros(nbytes // ITEMSIZE)

        every = b.mpi.check_every

        def call(debug: bool, check: bool = True, buf: torch.Tensor = buf, every: int = every) -> Column:
            def run() -> None:
                b.mpi.debug = debug  # the same value on every rank, as debug mode requires
                b.mpi._every = every if check else 0  # the agreement check (a plain attribute: no cost to switch)
                b.mpi.allreduce(buf)

            return run

        warmup = b.warmup_for(nbytes)
        columns = {"check off": call(False, False), "debug off": call(False), "debug on": call(True)}
        try:
            samples, reps = b.alternate(columns, warmup=warmup)
        finally:
            b.mpi.debug = False
            b.mpi._every = every
        for column, seconds in samples.items():
            records.append(_record("debug", "allreduce", column, nbytes, seconds, reps, warmup, b))
    return records


def _record(
    section: str,
    op: str,
    column: str,
    nbytes: int,
    seconds: Sequence[float],
    reps: int,
    warmup: int,
    b: Bench,
    *,
    pingpong: bool = False,
) -> dict[str, Any]:
    stats = report.summarize(seconds)
    return {
        "section": section,
        "op": op,
        "column": column,
        "backend": _engine(column, b),
        "bytes": nbytes,
        "elements": nbytes // ITEMSIZE,
        "reps": reps,
        "warmup": warmup,
        "timing": "rank 0, half round trip"
        if pingpong
        else ("rank 0" if section in ("copy", "root") else "max over ranks"),
        "median_us": stats["median"] * 1e6,
        "p10_us": stats["p10"] * 1e6,
        "p90_us": stats["p90"] * 1e6,
        "min_us": stats["min"] * 1e6,
        "max_us": stats["max"] * 1e6,
        "gbps": nbytes / stats["median"] / 1e9,
        "correct": True,  # checked before timing; a wrong result stops the job
        "samples_s": [round(x, 9) for x in seconds],  # every repetition, for other statistics later
    }


def _engine(column: str, b: Bench) -> str:
    if column.startswith("hpdl-mpi") or column.startswith("debug"):
        return f"hpdl mpi ({b.mpi.engine})"
    if column.startswith("hpdl-torch"):
        return f"hpdl torch ({b.gloo.engine})"
    if column.startswith("mpi4py"):
        return f"mpi4py ({b.mpi.engine})"
    if column.startswith("torch.distributed"):
        return str(b.gloo.engine)
    return "local"


# --------------------------------------------------------------------------- report (rank 0)
def configuration(b: Bench) -> dict[str, Any]:
    """Everything needed to rerun the measurement; printed as the header and merged into every JSON record."""
    import torch

    o = b.options
    return report.environment(
        benchmark="hpdl bench comm",
        ranks=b.size,
        threads_per_rank=torch.get_num_threads(),
        dtype="float32",
        sizes=list(o.sizes),
        quick=o.quick,
        iters_max=o.iters,
        iters_min=o.min_iters,
        budget_s=o.budget,
        warmup=o.warmup,
        warmup_from_1mib=min(2, o.warmup),
        timing=TIMING,
        tensors=SEPARATE_TENSORS,
        size_meaning=SIZE_MEANING,
        hpdl_mpi_engine=b.mpi.engine,
        hpdl_mpi_calls=b.mpi.calls,
        hpdl_shm_thresholds=getattr(b.mpi, "shm_thresholds_source", ""),
        hpdl_pairs=getattr(b.mpi, "pairs", ""),
        hpdl_torch_engine=b.gloo.engine,
        fusion_tensors=FUSION_TENSORS,
        fusion_tensor_bytes=FUSION_BYTES,
        hpdl_fusion_mb=f"{settings.number('HPDL_FUSION_MB'):g}",
        debug_sizes=list(DEBUG_SIZES),
        raw_torch_allgather=f"torch.distributed.{b.all_gather.__name__}",
        raw_torch_reduce_scatter=f"torch.distributed.{b.reduce_scatter.__name__}",
        load_average_start=round(b.load_at_start, 2),
        load_average_end=round(os.getloadavg()[0], 2),
    )


def write_report(b: Bench, records: list[dict[str, Any]], elapsed: float) -> None:
    config = configuration(b)
    sizes = b.options.sizes
    busy = max(config["load_average_start"], config["load_average_end"])
    note = (
        f"\n\n> Note: 1-minute load average {config['load_average_start']} at start, {config['load_average_end']} at "
        f"the end, on {config['cpu_count']} CPUs: other work shared this machine, so absolute times are inflated "
        "and noisier; the ratios come from alternating repetitions and suffer less."
        if busy > 0.5
        else ""
    )
    sections = [
        "## hpdl bench comm\n\n" + "\n".join(header_lines(config)) + note,
        "## Latency (µs, median [p10, p90]) and bandwidth (GB/s)\n\n"
        "Ratios are ratios of medians; gloo = raw torch.distributed on gloo. Copy = `dst.copy_(src)` in one "
        "process (rank 0), printed for sizes >= 64 KiB; '% of copy' = copy time / hpdl-mpi time.\n\n"
        + op_tables(records, sizes),
        "## Back-to-back calls (µs per call, median [p10, p90] over repetitions)\n\n"
        f"Each repetition: one barrier, then {10 if b.options.quick else LOOP_CALLS} calls in a row (OSU-style); "
        "the per-call cost without the barrier's exit skew that the tables above carry.\n\n" + loop_table(records),
        f"## Broadcast, the root's time ({10 if b.options.quick else ROOT_CALLS} calls back to back from rank 0, µs "
        "per call on rank 0, median [p10, p90] over repetitions)\n\n" + root_table(records),
        f"## Tensor fusion ({FUSION_TENSORS} tensors of {report.format_bytes(FUSION_BYTES)}, allreduce sum)\n\n"
        + fusion_table(records),
        "## Agreement check and debug mode (hpdl-mpi allreduce; the check runs every "
        f"{b.mpi.check_every} calls by default)\n\n" + debug_table(records),
        "## Targets\n\n" + "\n".join(targets(records, sizes)),
    ]
    text = "\n\n".join(sections) + "\n"
    os.makedirs(b.options.out, exist_ok=True)
    json_path = os.path.join(b.options.out, "comm.json")
    md_path = os.path.join(b.options.out, "comm.md")
    png_path = os.path.join(b.options.out, "comm.png")
    with open(md_path, "w") as md:
        md.write(text)
    report.write_records(json_path, records, config)
    drawn = plot(png_path, records, config)
    print(text, flush=True)
    written = [json_path, md_path] + ([png_path] if drawn else [])
    print(f"wrote {', '.join(written)} in {elapsed:.0f} s", flush=True)


# --------------------------------------------------------------------------- worker
def main(argv: Optional[list[str]] = None) -> int:
    """`launch` by default; with --worker, `worker` (every rank)."""
    return report.run_main(argv, parse, launch, worker)


def worker(options: Options) -> int:
    """The worker (every rank): both communicators in one process, all measurements, report on rank 0."""
    import hpdl

    started = perf_counter()
    mpi = hpdl.init("mpi", timeout=120.0, debug=False)
    gloo = hpdl.init("torch", timeout=120.0, debug=False)
    bench = Bench(options, mpi, gloo)
    if mpi.rank == 0:
        print(f"hpdl bench comm: {mpi.size} ranks, MPI {mpi.engine}, torch {gloo.engine}; measuring ...", flush=True)
    # An exception here reaches hpdl's excepthook, which aborts every rank: no finalize on a broken job.
    records = measure_ops(bench)
    records += measure_loops(bench)
    records += measure_root(bench)
    records += measure_copy(bench)
    records += measure_fusion(bench)
    records += measure_debug(bench)
    if mpi.rank == 0:
        write_report(bench, records, perf_counter() - started)
    mpi.barrier()
    hpdl.finalize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
