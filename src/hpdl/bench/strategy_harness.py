"""One harness for the strategy benchmarks (`hpdl bench train --strategy dp|zero|pipeline|hybrid|spatial|gems|branch`).

Each of them parses the same options (ranks, --quick, --out, rounds, steps,
timeout), starts itself on its ranks with `python -m`, opens hpdl's MPI (and
gloo) communicators on every rank, times its contenders in alternating
rounds, and writes one Markdown and one JSON report on rank 0 with target
lines that say what was met. A bench module declares a `Bench` (its name,
defaults and own options) and its contenders, models, measurement and
report; this module does the rest, so the seven agree on how they are run.

The ranks get the launcher's own command line plus `--worker` (and the
output folder made absolute): they parse exactly the options the user gave,
so nothing has to be written out twice.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from hpdl.bench import report
from hpdl.bench.arguments import positive

__all__ = ["Bench", "Options", "Ranks", "parse", "launch", "main", "worker", "write", "config", "alternate", "faster"]


def _no_options(parser: argparse.ArgumentParser) -> None:
    return None


def _no_check(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Bench:
    """What a strategy benchmark declares: its name, module, defaults and own options."""

    strategy: str
    module: str
    description: str
    out: str
    rounds: tuple[int, int]
    """Timed rounds (default, with --quick); each round times every contender once."""
    steps: Optional[tuple[int, int]] = (5, 2)
    """Steps per timed sample (default, with --quick); None: the bench has no --steps."""
    warmup: tuple[int, int] = (2, 1)
    """Untimed steps per contender before the first round (default, with --quick)."""
    timeout: float = 1800.0
    ranks: int = 2
    ranks_help: str = "MPI processes"
    quick_help: str = "few rounds and steps (a smoke test, seconds)"
    strategies: tuple[str, ...] = ()
    """Choices of a visible --strategy (the dp bench, which hands the others on); empty: hidden, only our own."""
    options: Callable[[argparse.ArgumentParser], None] = _no_options
    """Adds the bench's own arguments."""
    check: Callable[[argparse.Namespace, argparse.ArgumentParser], dict[str, Any]] = _no_check
    """Validates the parsed arguments (`parser.error` for bad ones) and returns the bench's own options."""

    @property
    def prog(self) -> str:
        return "hpdl bench train" + ("" if self.strategy == "dp" else f" --strategy {self.strategy}")


@dataclass(frozen=True)
class Options:
    """One run's options: the common ones as fields, the bench's own as attributes (`options.models`)."""

    strategy: str
    ranks: int
    quick: bool
    out: str
    rounds: int
    steps: int
    warmup: int
    timeout: float
    worker: bool = False
    argv: tuple[str, ...] = ()
    own: Mapping[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        own = self.__dict__.get("own") or {}
        if name in own:
            return own[name]
        raise AttributeError(f"the {self.__dict__.get('strategy')} benchmark has no option {name!r}")

    def forwarded(self, *more: str) -> list[str]:
        """The ranks' command line: the user's, `more`, --worker and the output folder made absolute."""
        return [*self.argv, *more, "--worker", "--out", os.path.abspath(self.out)]


def build_parser(bench: Bench) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=bench.prog, description=bench.description)
    if bench.strategies:
        parser.add_argument(
            "--strategy",
            default=bench.strategy,
            choices=list(bench.strategies),
            help="parallel strategy (dp: data parallel; zero, pipeline, hybrid, spatial, gems, branch: see their "
            "own --help)",
        )
    else:
        parser.add_argument("--strategy", default=bench.strategy, choices=[bench.strategy], help=argparse.SUPPRESS)
    parser.add_argument(
        "-n", "--ranks", type=positive(int), default=bench.ranks, help=f"{bench.ranks_help} (default {bench.ranks})"
    )
    parser.add_argument("--quick", action="store_true", help=bench.quick_help)
    parser.add_argument("--out", default=bench.out, help=f"output folder (default {bench.out})")
    parser.add_argument("--rounds", type=positive(int), help=f"timed rounds (default {bench.rounds[0]})")
    if bench.steps is not None:
        parser.add_argument("--steps", type=positive(int), help=f"steps per timed sample (default {bench.steps[0]})")
    parser.add_argument("--timeout", type=positive(float), default=bench.timeout, help="stop the job after this many s")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    bench.options(parser)
    return parser


def parse(bench: Bench, argv: Sequence[str]) -> Options:
    """The options of `argv`; argparse exits (2) for bad ones, with the reason."""
    parser = build_parser(bench)
    ns = parser.parse_args(list(argv))
    quick = bool(ns.quick)
    own = bench.check(ns, parser)
    steps = bench.steps or (1, 1)
    return Options(
        strategy=bench.strategy,
        ranks=ns.ranks,
        quick=quick,
        out=ns.out,
        rounds=ns.rounds or bench.rounds[quick],
        steps=getattr(ns, "steps", None) or steps[quick],
        warmup=bench.warmup[quick],
        timeout=ns.timeout,
        worker=bool(ns.worker),
        argv=tuple(argv),
        own=own,
    )


def launch(bench: Bench, argv: Sequence[str], start: Optional[Callable[[Options], int]] = None) -> int:
    """Parse `argv` and start the bench on its ranks (`start`, by default `python -m module` on `ranks`);
    return the job's exit code (2 for bad arguments)."""

    def on_ranks(options: Options) -> int:
        return report.run_worker(bench.prog, bench.module, options.ranks, options.forwarded(), options.timeout)

    return report.launch_parsed(lambda args: parse(bench, args), argv, start or on_ranks)


def main(
    bench: Bench,
    launch: Callable[[list[str]], int],
    worker: Callable[[Options], int],
    argv: Optional[Sequence[str]] = None,
) -> int:
    """A bench module's `main`: `launch` by default, `worker` on every rank with --worker."""
    return report.run_main(argv, lambda args: parse(bench, args), launch, worker)


# --------------------------------------------------------------------------- the ranks
@dataclass
class Ranks:
    """A worker's communicators: hpdl over MPI, and over torch.distributed (gloo) where the bench compares it."""

    mpi: Any
    gloo: Any = None

    @property
    def rank(self) -> int:
        return int(self.mpi.rank)

    @property
    def size(self) -> int:
        return int(self.mpi.size)


def worker(
    measure: Callable[[Ranks], list[dict[str, Any]]],
    write: Callable[[Ranks, list[dict[str, Any]], float], None],
    *,
    gloo: bool = True,
    timeout: float = 300.0,
    announce: Optional[Callable[[Ranks], str]] = None,
    finalize: bool = True,
) -> int:
    """Every rank: open the communicators (one torch thread per rank, no debug checks), `measure`, then
    `write(ranks, records, elapsed)` on rank 0; all ranks leave together."""
    import torch

    import hpdl

    started = time.perf_counter()
    if gloo:
        ranks = Ranks(*report.worker_communicators(timeout))
    else:
        torch.set_num_threads(1)
        ranks = Ranks(hpdl.init("mpi", timeout=timeout, debug=False))
    if announce is not None and ranks.rank == 0:
        print(announce(ranks), flush=True)
    records = measure(ranks)
    if ranks.rank == 0:
        write(ranks, records, time.perf_counter() - started)
    ranks.mpi.barrier()
    if finalize:
        hpdl.finalize()
    return 0


def alternate(
    count: int, rounds: int, run: Callable[[int], None], sync: Callable[[int], Any], mpi: Any = None
) -> np.ndarray:
    """Seconds of `run(i)` for each of `count` contenders and each round, contenders alternating within a round
    (A B C A B C ...) so that drift on a shared machine hits them alike; `sync(i)` (the contender's own
    barrier) before and after each. With `mpi`, each sample is the slowest rank's."""
    times = np.zeros((count, rounds))
    for r in range(rounds):
        for i in range(count):
            sync(i)
            start = time.perf_counter()
            run(i)
            times[i, r] = time.perf_counter() - start
            sync(i)
    if mpi is not None:
        from mpi4py import MPI

        mpi.mpi_comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)  # a sample lasts until its slowest rank finishes
    return times


# --------------------------------------------------------------------------- the report
def config(options: Options, ranks: Ranks, benchmark: str = "train", **extra: Any) -> dict[str, Any]:
    """The configuration stored in every record: the machine, the run's options, the engines, `extra`."""
    engines = {"mpi_engine": ranks.mpi.engine}
    if ranks.gloo is not None:
        engines["gloo_engine"] = ranks.gloo.engine
    return report.environment(
        benchmark=benchmark,
        strategy=options.strategy,
        quick=options.quick,
        world_ranks=ranks.size,
        rounds=options.rounds,
        **engines,
        **extra,
    )


def write(
    options: Options,
    name: str,
    text: tuple[str, str, Sequence[str], Sequence[str], Optional[Sequence[str]]],
    records: Sequence[Mapping[str, Any]],
    settings: Mapping[str, Any],
    elapsed: float,
) -> None:
    """`out`/`name`.md from (title, header, blocks, notes, targets) and `out`/`name`.json; both printed."""
    title, header, blocks, notes, targets = text
    markdown = report.markdown_document(title, header, blocks, notes, targets)
    report.write_report(options.out, name, markdown, records, settings, elapsed)


def faster(subject: str, got: float, peer: str, target: float, suffix: str = "") -> str:
    """A target line for a speed ratio: 'PASS mlp: hpdl-mpi 1.23x DDP's samples/s (target >= 1.1x)'."""
    return f"{report.verdict(got >= target)} {subject} {got:.2f}x {peer} (target >= {target}x){suffix}"
