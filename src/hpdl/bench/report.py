"""Helpers shared by every `hpdl bench ...`: launching, statistics, Markdown, JSON records, plots.

The rules in BENCHMARKING.md (medians with spread, the full configuration
in every record, machine-readable output beside a short table) are easier
to keep when every benchmark starts and reports through the same few functions.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, TypeVar

import numpy as np

from hpdl.runtime import spawn
from hpdl.runtime.machine import describe as environment

__all__ = [
    "launch_parsed",
    "launch_benchmark",
    "run_main",
    "worker_communicators",
    "verdict",
    "markdown_document",
    "write_report",
    "summarize",
    "markdown_table",
    "write_records",
    "environment",
    "plot_panels",
    "format_bytes",
    "parse_bytes",
]


T = TypeVar("T")


class _WorkerOptions(Protocol):
    @property
    def worker(self) -> bool: ...


W = TypeVar("W", bound=_WorkerOptions)


def launch_parsed(parse: Callable[[list[str]], T], argv: Sequence[str], start: Callable[[T], int]) -> int:
    """Parse `argv`, then `start(options)`; argparse's exits (2 for bad arguments, 0 for --help) become the
    return code, so that a benchmark launched from the CLI or a test never exits its caller."""
    try:
        options = parse(list(argv))
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 0
    return start(options)


def launch_benchmark(
    name: str, module: str, parse: Callable[[list[str]], Any], argv: Sequence[str], *, ranks: Optional[int] = None
) -> int:
    """Parse `argv` and run `python -m module` with `--worker` on its ranks; return the job's exit code.

    The options need `forwarded()` (the worker's arguments), `timeout` and,
    unless `ranks` is given, `ranks`.
    """

    def start(options: Any) -> int:
        count = options.ranks if ranks is None else ranks
        return run_worker(name, module, count, options.forwarded(), options.timeout)

    return launch_parsed(parse, argv, start)


def run_worker(name: str, module: str, ranks: int, forwarded: list[str], timeout: float) -> int:
    """`python -m module *forwarded` on `ranks` MPI ranks, one thread each (shared by every benchmark)."""
    env = spawn.job_environment("mpi", ranks)
    env["OMP_NUM_THREADS"] = "1"
    print(f"{name}: {ranks} ranks of python -m {module} {' '.join(forwarded)}", flush=True)
    try:
        return spawn.run(ranks, ["-m", module, *forwarded], env=env, timeout=timeout, name=name)
    except FileNotFoundError as missing:
        print(f"{name}: {missing}", file=sys.stderr)
        return 127


def run_main(
    argv: Optional[Sequence[str]],
    parse: Callable[[list[str]], W],
    launch: Callable[[list[str]], int],
    worker: Callable[[W], int],
) -> int:
    """A benchmark module's `main`: `launch` (start the ranks) by default, `worker` on every rank with --worker.

    Parsing first makes bad arguments exit here, as `python -m` expects.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    options = parse(args)
    if not options.worker:
        return launch(args)
    return worker(options)


def worker_communicators(timeout: float) -> tuple[Any, Any]:
    """hpdl's MPI and torch (gloo) communicators over the same ranks, with one torch thread per rank (the ranks
    share the machine's cores) and no debug checks (they would be part of the measurement)."""
    import torch

    import hpdl

    torch.set_num_threads(1)
    return hpdl.init("mpi", timeout=timeout, debug=False), hpdl.init("torch", timeout=timeout, debug=False)


def verdict(ok: bool) -> str:
    """'PASS' or 'MISS' before a target line: a missed target is reported, it does not fail the run."""
    return "PASS" if ok else "MISS"


def markdown_document(
    title: str, header: str, blocks: Sequence[str], notes: Sequence[str], targets: Optional[Sequence[str]] = None
) -> str:
    """The report's Markdown: '# title', the header line, the blocks (tables, headings), the notes as a list,
    then '## Targets' with one line per target (when given). No final newline."""
    lines = [f"# {title}", "", header, ""]
    for block in blocks:
        lines += [block, ""]
    lines += [f"- {n}" for n in notes]
    if targets is not None:
        lines += ["", "## Targets", ""] + [f"- {t}" for t in targets]
    return "\n".join(lines)


def write_report(
    out: str, name: str, markdown: str, records: Sequence[Mapping[str, Any]], config: Mapping[str, Any], elapsed: float
) -> None:
    """Write `out`/`name`.md and `out`/`name`.json (the records, each with `config`), then print the Markdown
    and what was written."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.md"), "w") as handle:
        handle.write(markdown + "\n")
    write_records(os.path.join(out, f"{name}.json"), records, config)
    print(markdown)
    print(f"\nwrote {out}/{name}.md and {name}.json in {elapsed:.0f} s")


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, p10, p90, min, max and count: one number alone is not a result."""
    if len(samples) == 0:
        raise ValueError("summarize: no samples; a measurement needs at least one repetition")
    data = np.asarray(samples, dtype=np.float64)
    p10, median, p90 = np.percentile(data, [10, 50, 90])
    return {
        "median": float(median),
        "p10": float(p10),
        "p90": float(p90),
        "min": float(data.min()),
        "max": float(data.max()),
        "n": int(data.size),
    }


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, right_align_from: int = 1) -> str:
    """A GitHub-style Markdown table; columns from `right_align_from` on are right-aligned (numbers)."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    for row in cells[1:]:
        if len(row) != len(headers):
            raise ValueError(f"markdown_table: a row has {len(row)} cells but there are {len(headers)} headers: {row}")
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    rule = [("-" * (w - 1) + ":") if i >= right_align_from else "-" * w for i, w in enumerate(widths)]

    def line(row: Sequence[str]) -> str:
        padded = [c.rjust(w) if i >= right_align_from else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "| " + " | ".join(padded) + " |"

    return "\n".join([line(cells[0]), line(rule)] + [line(row) for row in cells[1:]])


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def write_records(path: str, records: Sequence[Mapping[str, Any]], config: Mapping[str, Any]) -> None:
    """Write a JSON list of self-contained records, one per measurement: its own fields plus the full `config`.

    Repeating the configuration in every record costs bytes but lets any
    single record be read (or concatenated with other runs) on its own.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    lines = [json.dumps({**config, **record}, default=_jsonable) for record in records]
    with open(path, "w") as out:  # a JSON list, one record per line: loads whole, greps and diffs by record
        out.write("[\n" + ",\n".join(lines) + "\n]\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


Series = tuple[Sequence[float], Sequence[float], Optional[Sequence[float]], Optional[Sequence[float]]]
"""(x, y, y_low, y_high) of one curve; the band may be None."""


def plot_panels(
    path: str,
    panels: Mapping[str, Mapping[str, Series]],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    loglog: bool = True,
) -> bool:
    """One subplot per panel, one line (with an optional p10-p90 band) per series, saved as PNG.

    matplotlib is optional (the `plot` extra): without it the plot is skipped
    with a note, because the numbers in JSON and Markdown are the result and
    the picture only helps to read them. Returns whether a file was written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"note: matplotlib is not installed, so {path} was not drawn (pip install 'hpdl[plot]')")
        return False
    count = len(panels)
    if count == 0:
        return False
    cols = min(3, count)
    rows = (count + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.0 * cols, 3.8 * rows), squeeze=False)
    for ax, (name, series) in zip(axes.flat, panels.items()):
        for label, (x, y, low, high) in series.items():
            (line,) = ax.plot(x, y, marker="o", markersize=3, label=label)
            if low is not None and high is not None:
                ax.fill_between(x, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        if loglog:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[count:]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def format_bytes(n: int) -> str:
    """'4 B', '64 KiB', '1 MiB': binary units, as message sizes are powers of two."""
    for unit, scale in _UNITS:
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def parse_bytes(text: str) -> int:
    """'4', '64K', '64KiB', '1M' -> bytes (binary multiples), with an error that shows the accepted forms."""
    raw = text.strip().upper().replace("IB", "").replace("B", "")
    scale = 1
    for suffix, factor in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if raw.endswith(suffix):
            raw, scale = raw[:-1], factor
            break
    try:
        value = int(raw) * scale
    except ValueError:
        raise ValueError(f"size {text!r} is not a byte count; write for example 4, 64K or 1M") from None
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value
