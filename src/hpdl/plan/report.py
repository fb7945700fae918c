"""Text for people: the ranking table, why the best plan wins, the ZeRO memory table.

Functions return strings; the command line prints them (nothing below
`cli` prints).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

from hpdl.plan.cost import Estimate
from hpdl.plan.memory import bubble_fraction, model_states
from hpdl.plan.profile import ModelProfile
from hpdl.plan.ranking import SearchResult

__all__ = [
    "markdown_table",
    "ranking_table",
    "why",
    "header",
    "memory_rows",
    "memory_table",
    "fmt_gb",
    "fmt_s",
    "describe",
]

PARTS = (
    ("compute", "compute"),
    ("tp_comm", "tensor-parallel allreduces"),
    ("p2p", "pipeline sends"),
    ("bubble", "the pipeline bubble"),
    ("dp_comm", "exposed data-parallel communication"),
    ("optimizer", "the optimizer step"),
    ("halo", "spatial halo exchange"),
)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table, numbers right-aligned (plan sits below bench, so it keeps its own small copy)."""
    cells = [[str(h) for h in headers]] + [[str(v) for v in row] for row in rows]
    widths = [max(3, *(len(row[i]) for row in cells)) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return (
            "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) + " |"
        )

    rule = "| " + " | ".join(("-" * w) if i == 0 else ("-" * (w - 1) + ":") for i, w in enumerate(widths)) + " |"
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def fmt_gb(nbytes: float) -> str:
    """GB (10^9 bytes) with 1 decimal at 10 GB and above, 3 below: 120.0, 31.4, 16.6, 1.875."""
    value = nbytes / 1e9
    return f"{value:.1f}" if value >= 10 else f"{value:.3f}"


def fmt_s(seconds: float) -> str:
    if seconds == 0:
        return "0"
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def describe(e: Estimate) -> str:
    """'dp32 x pp4 x tp8, ZeRO-2, 32 micro-batches of 1, 1f1b' (and ' x sp4 (spatial ...)' for a spatial plan)."""
    c = e.candidate
    spatial = f" x sp{c.sp} (spatial: each sample's height split in {c.sp} slabs)" if c.sp > 1 else ""
    text = f"dp{c.dp} x pp{c.pp} x tp{c.tp}{spatial}, " + (f"ZeRO-{c.zero}" if c.zero else "no ZeRO")
    if c.zero == 3 and not c.reshard:
        text += " (units kept gathered across micro-batches)"
    if c.pp > 1:
        text += f", {c.micro_batches} micro-batches of {e.micro_batch}, {c.schedule}"
        if c.recompute != "never":
            text += f", recompute {c.recompute}"
    return text


def _layer_count(profile: ModelProfile) -> str:
    """How many layers the profile has (the units that pipeline stages are cut between), and of which kinds when
    some repeat: `14 layers to place in stages: embedding + 12 x block + head` (a GPT-2 of 12 blocks)."""
    kinds: dict[str, int] = {}
    for layer in profile.layers:
        kind = layer.name.split(".")[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    text = f"{len(profile.layers)} layers to place in stages"
    if len(kinds) < len(profile.layers):
        text += ": " + " + ".join(kind if n == 1 else f"{n} x {kind}" for kind, n in kinds.items())
    return text


def header(result: SearchResult) -> str:
    p, cl, wl = result.profile, result.cluster, result.workload
    return "\n".join(
        [
            f"model    {p.name}: {p.params / 1e6:,.1f} M parameters, {p.flops / 1e9:,.3g} GFLOP forward per "
            f"{p.sample} ({_layer_count(p)}; {p.source})",
            f"cluster  {cl.name}: {result.devices} of {cl.nodes} x {cl.devices_per_node} devices, "
            f"{cl.memory_bytes / 1e9:g} GB each; {cl.source or 'no source given'}",
            f"workload global batch {wl.batch}, {wl.precision} precision, {wl.optimizer}, {wl.bucket_mb:g} MB buckets",
            f"search   {len(result.estimates)} candidates, {len(result.feasible)} fit, "
            f"in {result.elapsed_s:.3g} s ({len(result.estimates) / max(result.elapsed_s, 1e-9):,.0f}/s)",
        ]
    )


def ranking_table(result: SearchResult, top: int = 10) -> str:
    """Markdown table of the `top` feasible plans with the step-time breakdown and memory."""
    rows: list[list[Any]] = []
    cap = result.cluster.memory_bytes
    shown: list[Estimate] = []
    for e in result.feasible:
        # GPipe at the same time and memory as the 1F1B row above it adds nothing to read: show one of them.
        twin = shown[-1] if shown else None
        if (
            twin
            and replace(twin.candidate, schedule=e.candidate.schedule) == e.candidate
            and (twin.step_s == e.step_s and twin.memory_bytes <= e.memory_bytes)
        ):
            continue
        shown.append(e)
        if len(shown) == top:
            break
    for rank, e in enumerate(shown, start=1):
        c = e.candidate
        rows.append(
            [
                rank,
                c.dp,
                c.pp,
                c.tp,
                c.sp,
                c.zero if c.reshard else f"{c.zero} keep",  # keep: reshard_after_forward = false
                c.micro_batches if c.pp > 1 else "-",
                c.schedule if c.pp > 1 else "-",
                c.recompute if c.pp > 1 else "-",
                fmt_s(e.step_s),
                f"{e.samples_per_s:,.1f}",
                fmt_s(e.compute_s),
                fmt_s(e.tp_comm_s + e.p2p_s + e.halo_s),
                fmt_s(e.bubble_s),
                fmt_s(e.dp_comm_s),
                f"{fmt_gb(e.memory_bytes)}/{cap / 1e9:g}",
            ]
        )
    headers = ["#", "dp", "pp", "tp", "sp", "zero", "m", "sched", "recompute", "step", "samples/s", "compute",
               "tp+p2p+halo", "bubble", "dp comm", "GB/device"]  # fmt: skip
    return markdown_table(headers, rows)


def _families() -> list[tuple[str, Callable[[Estimate], bool]]]:
    return [
        ("pure data-parallel plan", lambda e: e.candidate.pp == 1 and e.candidate.tp == 1 and e.candidate.sp == 1),
        ("plan with spatial parallelism", lambda e: e.candidate.sp > 1),
        ("plan with pipeline parallelism", lambda e: e.candidate.pp > 1),
        ("plan without pipeline parallelism", lambda e: e.candidate.pp == 1),
        ("plan with tensor parallelism", lambda e: e.candidate.tp > 1),
        ("plan without tensor parallelism", lambda e: e.candidate.tp == 1),
        ("plan without ZeRO-3", lambda e: e.candidate.zero < 3),
    ]


def _parts(e: Estimate) -> dict[str, float]:
    return {
        "compute": e.compute_s,
        "tp_comm": e.tp_comm_s,
        "p2p": e.p2p_s,
        "bubble": e.bubble_s,
        "dp_comm": e.dp_comm_s,
        "optimizer": e.optimizer_s,
        "halo": e.halo_s,
    }


def why(result: SearchResult) -> str:
    """Sentences that say why the best plan wins over the best of each other family of plans."""
    best = result.best
    cap = result.cluster.memory_bytes
    if best is None:
        smallest = min(result.estimates, key=lambda e: e.memory_bytes)
        return (
            f"No plan fits in {cap / 1e9:g} GB per device: the leanest, {describe(smallest)}, needs "
            f"{fmt_gb(smallest.memory_bytes)} GB. Use more devices, a smaller batch or a smaller model."
        )
    lines = [
        f"Best: {describe(best)}: {fmt_s(best.step_s)} per step ({best.samples_per_s:,.1f} samples/s), "
        f"{fmt_gb(best.memory_bytes)} of {cap / 1e9:g} GB per device."
    ]
    ours = _parts(best)
    told: set[int] = set()
    for name, member in _families():
        if member(best):
            continue
        family = [e for e in result.estimates if member(e)]
        if not family:
            continue
        fitting = [e for e in family if e.fits]
        if not fitting:
            lean = min(family, key=lambda e: e.memory_bytes)
            lines.append(f"No {name} fits: the leanest ({describe(lean)}) needs {fmt_gb(lean.memory_bytes)} GB.")
            continue
        other = fitting[0]
        if id(other) in told:
            continue
        told.add(id(other))
        theirs = _parts(other)
        diffs = {k: theirs[k] - ours[k] for k in ours}
        worst = max(diffs, key=lambda k: diffs[k])
        label = dict(PARTS)[worst]
        ratio = other.step_s / best.step_s if best.step_s else float("inf")
        lines.append(
            f"The best {name} ({describe(other)}) is {ratio:.2f}x slower, mostly from {label} "
            f"(+{fmt_s(diffs[worst])} per step)."
        )
    return " ".join(lines)


def memory_rows(
    params: float, dp: int, optimizer: str, precision: str
) -> list[dict[str, Any]]:  # fmt: skip
    """Per-device model-state bytes for plain data parallelism and ZeRO 1, 2, 3 (the ZeRO paper's Figure 1)."""
    rows = []
    for stage, name in ((0, "DP"), (1, "ZeRO-1"), (2, "ZeRO-2"), (3, "ZeRO-3")):
        s = model_states(params, dp, stage, optimizer, precision)
        rows.append(
            {
                "strategy": name,
                "stage": stage,
                "params_GB": s.params / 1e9,
                "grads_GB": s.grads / 1e9,
                "optimizer_GB": s.optimizer / 1e9,
                "total_GB": s.total / 1e9,
            }
        )
    return rows


def memory_table(
    params: float, dp: int, optimizer: str, precision: str, pp: Optional[int] = None, micro: Optional[int] = None
) -> str:
    rows = memory_rows(params, dp, optimizer, precision)
    table = markdown_table(
        ["strategy", "params GB", "grads GB", "optimizer GB", "total GB per device"],
        [
            [r["strategy"], fmt_gb(r["params_GB"] * 1e9), fmt_gb(r["grads_GB"] * 1e9),
             fmt_gb(r["optimizer_GB"] * 1e9), fmt_gb(r["total_GB"] * 1e9)]
            for r in rows
        ],
    )  # fmt: skip
    lines = [
        f"model states of {params:.4g} parameters over {dp} data-parallel ranks, {optimizer}, {precision} precision",
        table,
    ]
    if pp:
        frac = bubble_fraction(pp, micro or 1)
        lines.append(
            f"pipeline bubble (p-1)/(m+p-1) with p={pp}, m={micro or 1}: {frac.numerator}/{frac.denominator} "
            f"= {float(frac):.4f}"
        )
    return "\n".join(lines)
