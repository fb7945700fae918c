"""The report of `hpdl bench comm` (rank 0): tables, PASS/MISS lines against the targets, and the plot."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from hpdl.bench import report
from hpdl.bench.comm_spec import (
    COLUMNS,
    DEBUG_SIZES,
    FUSION_TENSORS,
    MIB,
    OPS,
    SHM_OPS,
    TARGET_FUSION,
    TARGET_FUSION_VS_FLAT,
    TARGET_SHM_64MB,
    TARGET_SHM_SPEEDUP,
    TARGET_SHM_SPEEDUP_FROM,
    TARGET_SMALL_UP_TO,
    TARGET_SMALL_VS_MPI4PY,
    TARGET_VS_GLOO,
    TARGET_VS_GLOO_FROM,
    TARGET_VS_MPI4PY,
    TARGET_VS_MPI4PY_FROM,
)

__all__ = ["op_tables", "loop_table", "root_table", "fusion_table", "debug_table", "targets", "header_lines", "plot"]


def _by(records: Sequence[dict[str, Any]], section: str) -> dict[tuple[str, int, str], dict[str, Any]]:
    return {(r["op"], r["bytes"], r["column"]): r for r in records if r["section"] == section}


def _lat(record: Optional[dict[str, Any]]) -> str:
    if record is None:
        return "-"
    return f"{_num(record['median_us'])} [{_num(record['p10_us'])}, {_num(record['p90_us'])}]"


def _num(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _ratio(a: Optional[dict[str, Any]], c: Optional[dict[str, Any]]) -> Optional[float]:
    return None if a is None or c is None else a["median_us"] / c["median_us"]


def _fmt_ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def op_tables(records: Sequence[dict[str, Any]], sizes: Sequence[int]) -> str:
    """One table per operation: latency median [p10, p90] in µs, bandwidth in GB/s, and the ratios."""
    lat, copies = _by(records, "latency"), _by(records, "copy")
    parts = []
    for op in OPS:
        headers = ["size"] + [f"{c} µs" for c in COLUMNS] + [f"{c} GB/s" for c in COLUMNS]
        headers += ["hpdl-mpi/mpi4py", "hpdl-mpi-shm/mpi4py", "hpdl-mpi/gloo", "hpdl-torch/gloo"]
        if op == "allreduce":
            headers += ["copy µs", "copy GB/s", "hpdl-mpi % of copy"]
        rows = []
        for n in sizes:
            cells = {c: lat.get((op, n, c)) for c in COLUMNS}
            row: list[Any] = [report.format_bytes(n)]
            row += [_lat(cells[c]) for c in COLUMNS]
            row += ["-" if cells[c] is None else f"{cells[c]['gbps']:.3g}" for c in COLUMNS]  # type: ignore[index]
            row += [
                _fmt_ratio(_ratio(cells["hpdl-mpi"], cells["mpi4py"])),
                _fmt_ratio(_ratio(cells["hpdl-mpi-shm"], cells["mpi4py"])),
                _fmt_ratio(_ratio(cells["hpdl-mpi"], cells["torch.distributed"])),
                _fmt_ratio(_ratio(cells["hpdl-torch"], cells["torch.distributed"])),
            ]
            if op == "allreduce":
                copy = copies.get(("copy", n, "memory copy"))
                share = _ratio(copy, cells["hpdl-mpi"])
                row += [
                    _lat(copy),
                    "-" if copy is None else f"{copy['gbps']:.3g}",
                    "-" if share is None else f"{100 * share:.0f}%",
                ]
            rows.append(row)
        title = {"sendrecv": "send/recv (ping-pong between ranks 0 and 1, half round trip)"}.get(op, op)
        parts.append(f"### {title}\n\n" + report.markdown_table(headers, rows))
    return "\n\n".join(parts)


def loop_table(records: Sequence[dict[str, Any]]) -> str:
    """Per-call cost in back-to-back calls: hpdl-mpi and mpi4py per op and size, and their ratio."""
    loops = _by(records, "loop")
    rows = []
    for op, n in dict.fromkeys((op, n) for op, n, _ in loops):
        ours, raw = loops.get((op, n, "hpdl-mpi")), loops.get((op, n, "mpi4py"))
        rows.append([op, report.format_bytes(n), _lat(ours), _lat(raw), _fmt_ratio(_ratio(ours, raw))])
    return report.markdown_table(["op", "size", "hpdl-mpi µs per call", "mpi4py µs per call", "hpdl-mpi/mpi4py"], rows)


def root_table(records: Sequence[dict[str, Any]]) -> str:
    """The root's time per broadcast in back-to-back calls: hpdl-mpi and mpi4py per size, and their ratio."""
    root = _by(records, "root")
    rows = []
    for n in sorted({n for _, n, _ in root}):
        ours, raw = root.get(("broadcast", n, "hpdl-mpi")), root.get(("broadcast", n, "mpi4py"))
        rows.append([report.format_bytes(n), _lat(ours), _lat(raw), _fmt_ratio(_ratio(ours, raw))])
    return report.markdown_table(["size", "hpdl-mpi µs per call", "mpi4py µs per call", "hpdl-mpi/mpi4py"], rows)


def fusion_table(records: Sequence[dict[str, Any]]) -> str:
    rows = []
    fusion = {r["column"]: r for r in records if r["section"] == "fusion"}
    for column, r in fusion.items():
        rows.append([column, _lat(r), f"{r['median_us'] / FUSION_TENSORS:.3g}", r["reps"]])
    lines = [report.markdown_table(["column", "µs per 200 tensors [p10, p90]", "µs per tensor", "reps"], rows)]
    lines.append("")
    for engine, raw in (("hpdl-mpi", "mpi4py"), ("hpdl-torch", "torch.distributed")):
        speedup = _ratio(fusion.get(f"{engine} separate"), fusion.get(f"{engine} coalesced"))
        floor = _ratio(fusion.get(f"{engine} coalesced"), fusion.get(f"{raw} one flat call"))
        lines.append(
            f"- {engine}: speed-up of coalesced over {FUSION_TENSORS} separate calls {_fmt_ratio(speedup)}; "
            f"coalesced takes {_fmt_ratio(floor)} the time of one raw {raw} call on the packed bytes"
        )
    return "\n".join(lines)


def debug_table(records: Sequence[dict[str, Any]]) -> str:
    debug = _by(records, "debug")
    rows = []
    for n in DEBUG_SIZES:
        off, on = debug.get(("allreduce", n, "debug off")), debug.get(("allreduce", n, "debug on"))
        unchecked = debug.get(("allreduce", n, "check off"))
        if off is None or on is None:
            continue
        extra = on["median_us"] - off["median_us"]
        check = [_lat(unchecked), f"{off['median_us'] - unchecked['median_us']:+.3g}"] if unchecked else ["-", "-"]
        rows.append([report.format_bytes(n), *check, _lat(off), _lat(on), f"{extra:+.3g}", _fmt_ratio(_ratio(on, off))])
    headers = [
        "size", "agreement check off µs", "check cost µs", "debug off µs (default)", "debug on µs", "debug overhead µs",
        "on/off",
    ]  # fmt: skip
    return report.markdown_table(headers, rows)


def targets(records: Sequence[dict[str, Any]], sizes: Sequence[int]) -> list[str]:
    """PASS/MISS lines for the stated targets (ratios of medians; a MISS does not fail the run)."""
    lat, loops = _by(records, "latency"), _by(records, "loop")
    lines = []
    big = [n for n in sizes if n >= TARGET_VS_MPI4PY_FROM]
    small = [n for n in sizes if n <= TARGET_SMALL_UP_TO]
    for op in OPS:
        if small:
            ratios = [(_ratio(lat.get((op, n, "hpdl-mpi")), lat.get((op, n, "mpi4py"))), n) for n in small]
            claim = f"{op}: hpdl-mpi within {TARGET_SMALL_VS_MPI4PY:.2f}x of mpi4py up to "
            lines.append(_verdict(claim + report.format_bytes(TARGET_SMALL_UP_TO), ratios, TARGET_SMALL_VS_MPI4PY))
            ratios = [(_ratio(loops.get((op, n, "hpdl-mpi")), loops.get((op, n, "mpi4py"))), n) for n in small]
            claim = f"{op}, back-to-back calls: hpdl-mpi within {TARGET_SMALL_VS_MPI4PY:.2f}x of mpi4py up to "
            lines.append(_verdict(claim + report.format_bytes(TARGET_SMALL_UP_TO), ratios, TARGET_SMALL_VS_MPI4PY))
        ratios = [(_ratio(lat.get((op, n, "hpdl-mpi")), lat.get((op, n, "mpi4py"))), n) for n in big]
        lines.append(
            _verdict(
                f"{op}: hpdl-mpi within {TARGET_VS_MPI4PY:.2f}x of mpi4py for >= "
                f"{report.format_bytes(TARGET_VS_MPI4PY_FROM)}",
                ratios,
                TARGET_VS_MPI4PY,
            )
        )
    root = _by(records, "root")
    root_sizes = sorted({n for _, n, _ in root})
    for claim, chosen, limit in (
        (f"up to {report.format_bytes(TARGET_SMALL_UP_TO)}", [n for n in root_sizes if n <= TARGET_SMALL_UP_TO],
         TARGET_SMALL_VS_MPI4PY),
        (f"from {report.format_bytes(TARGET_VS_MPI4PY_FROM)}", [n for n in root_sizes if n >= TARGET_VS_MPI4PY_FROM],
         TARGET_VS_MPI4PY),
    ):  # fmt: skip
        if chosen:
            ratios = [
                (_ratio(root.get(("broadcast", n, "hpdl-mpi")), root.get(("broadcast", n, "mpi4py"))), n)
                for n in chosen
            ]
            lines.append(
                _verdict(
                    f"broadcast, the root's time back to back: hpdl-mpi within {limit:.2f}x of mpi4py {claim}",
                    ratios,
                    limit,
                )
            )
    ratios = [
        (_ratio(lat.get(("allreduce", n, "hpdl-mpi")), lat.get(("allreduce", n, "torch.distributed"))), n)
        for n in sizes
        if n >= TARGET_VS_GLOO_FROM
    ]
    lines.append(
        _verdict(
            f"allreduce: hpdl-mpi at most {TARGET_VS_GLOO}x the time of torch.distributed (gloo) for >= "
            f"{report.format_bytes(TARGET_VS_GLOO_FROM)}",
            ratios,
            TARGET_VS_GLOO,
        )
    )
    for op in SHM_OPS:
        # Ratios here are mpi4py time / hpdl-mpi-shm time: speed-ups, larger is better.
        speedups = {n: _ratio(lat.get((op, n, "mpi4py")), lat.get((op, n, "hpdl-mpi-shm"))) for n in sizes}
        large = [(s, n) for n, s in speedups.items() if n >= TARGET_SHM_SPEEDUP_FROM and s is not None]
        worst = min(large, default=(None, 0))
        ok = worst[0] is not None and worst[0] >= TARGET_SHM_SPEEDUP
        detail = ", ".join(f"{report.format_bytes(n)}: {s:.2f}x" for s, n in large)
        lines.append(
            f"{'PASS' if ok else 'MISS'}  {op}: hpdl-mpi-shm at least {TARGET_SHM_SPEEDUP}x faster than mpi4py "
            f"from {report.format_bytes(TARGET_SHM_SPEEDUP_FROM)} up ({detail or 'no size measured'})"
        )
        slower = [f"{report.format_bytes(n)}: {s:.2f}x" for n, s in speedups.items() if s is not None and s < 1.0]
        lines.append(
            f"{'PASS' if not slower else 'MISS'}  {op}: hpdl-mpi-shm never slower than mpi4py"
            + (f" (slower at {', '.join(slower)})" if slower else "")
        )
    speedups_64 = _ratio(lat.get(("allreduce", 64 * MIB, "mpi4py")), lat.get(("allreduce", 64 * MIB, "hpdl-mpi-shm")))
    if speedups_64 is not None:
        lines.append(
            f"{'PASS' if speedups_64 >= TARGET_SHM_64MB else 'MISS'}  allreduce 64 MiB: hpdl-mpi-shm at least "
            f"{TARGET_SHM_64MB:g}x faster than mpi4py ({speedups_64:.2f}x)"
        )
    fusion = {r["column"]: r for r in records if r["section"] == "fusion"}
    for engine, raw in (("hpdl-mpi", "mpi4py"), ("hpdl-torch", "torch.distributed")):
        speedup = _ratio(fusion.get(f"{engine} separate"), fusion.get(f"{engine} coalesced"))
        ok = speedup is not None and speedup >= TARGET_FUSION
        # No fusion beats one raw call on the packed bytes: separate calls that cost little cap the speed-up.
        ceiling = _ratio(fusion.get(f"{engine} separate"), fusion.get(f"{raw} one flat call"))
        lines.append(
            f"{'PASS' if ok else 'MISS'}  fusion ({engine}): coalesced >= {TARGET_FUSION:g}x faster than "
            f"{FUSION_TENSORS} separate calls (speed-up {_fmt_ratio(speedup)}; one raw {raw} call on the packed "
            f"bytes would be {_fmt_ratio(ceiling)})"
        )
    flat = _ratio(fusion.get("hpdl-mpi coalesced"), fusion.get("mpi4py one flat call"))
    lines.append(
        f"{'PASS' if flat is not None and flat <= TARGET_FUSION_VS_FLAT else 'MISS'}  fusion (hpdl-mpi): coalesced "
        f"at most {TARGET_FUSION_VS_FLAT:g}x one raw mpi4py call on the packed bytes ({_fmt_ratio(flat)})"
    )
    return lines


def _verdict(claim: str, ratios: Sequence[tuple[Optional[float], int]], limit: float) -> str:
    """PASS when the worst (largest) ratio over the sizes in range is within `limit`."""
    known = [(r, n) for r, n in ratios if r is not None]
    if not known:
        return f"MISS  {claim} (no size in range was measured)"
    ratio, n = max(known, key=lambda item: item[0])
    ok = ratio <= limit
    detail = ", ".join(f"{report.format_bytes(m)}: {r:.2f}x" for r, m in known)
    return f"{'PASS' if ok else 'MISS'}  {claim} (worst {ratio:.2f}x at {report.format_bytes(n)}; {detail})"


def header_lines(config: Mapping[str, Any]) -> list[str]:
    keys = (
        "benchmark", "date", "hostname", "cpu", "cpu_count", "ranks", "threads_per_rank", "omp_num_threads",
        "mpi_library_version", "mpi4py_version", "hpdl_mpi_engine", "hpdl_mpi_calls",
        "hpdl_shm_thresholds", "hpdl_pairs", "hpdl_torch_engine", "torch_version",
        "numpy_version", "python", "hpdl_version", "dtype", "sizes", "quick", "iters_max", "iters_min", "budget_s",
        "warmup", "warmup_from_1mib", "fusion_tensors", "fusion_tensor_bytes", "hpdl_fusion_mb", "debug_sizes",
        "raw_torch_allgather", "raw_torch_reduce_scatter", "load_average_start", "load_average_end", "timing",
        "tensors", "size_meaning",
    )  # fmt: skip
    return [f"- {k}: {config.get(k)}" for k in keys]


def plot(path: str, records: Sequence[dict[str, Any]], config: Mapping[str, Any]) -> bool:
    """Latency vs size, one panel per operation, one line (with p10-p90 band) per column; log-log."""
    lat, copies = _by(records, "latency"), _by(records, "copy")
    panels: dict[str, dict[str, report.Series]] = {}
    for op in OPS:
        series: dict[str, report.Series] = {}
        for column in COLUMNS:
            rs = sorted((r for (o, _, c), r in lat.items() if o == op and c == column), key=lambda r: r["bytes"])
            if rs:
                series[column] = (
                    [r["bytes"] for r in rs],
                    [r["median_us"] for r in rs],
                    [r["p10_us"] for r in rs],
                    [r["p90_us"] for r in rs],
                )
        if op == "allreduce" and copies:
            rs = sorted(copies.values(), key=lambda r: r["bytes"])
            series["memory copy (1 process)"] = ([r["bytes"] for r in rs], [r["median_us"] for r in rs], None, None)
        panels[op] = series
    title = (
        f"hpdl bench comm: {config['ranks']} ranks x {config['threads_per_rank']} thread, float32, "
        f"{config['hpdl_mpi_engine']}, torch {config['torch_version']} (median, p10-p90)"
    )
    return report.plot_panels(path, panels, xlabel="message size (bytes)", ylabel="latency (µs)", title=title)
