"""A text picture of the slabs, output rows and halos of each window layer, drawn from the layers' own plans."""

from __future__ import annotations

from typing import Any

__all__ = ["describe_layers"]


def describe_layers(layers: list[tuple[str, Any]], rows: int, ranks: int, axis: int = 0) -> str:
    """One block per window layer: per rank, owned input rows, output rows, halo rows above/below and their source.

    `axis`: which split dimension of a grid split (its ranks are the ranks along that axis)."""
    from hpdl.parallel.spatial.layers import SpatialFlatten, SpatialGlobalPool, _WindowLayer
    from hpdl.parallel.spatial.partition import window_output_size

    lines = [f"input: {rows} rows over {ranks} ranks" + (f" (grid axis {axis})" if axis else "")]
    n = rows
    for name, layer in layers:
        if isinstance(layer, (SpatialGlobalPool, SpatialFlatten)):
            lines.append(f"{name}: {type(layer).__name__}: slabs reduced, the rest runs replicated")
            break
        if not isinstance(layer, _WindowLayer):
            lines.append(
                f"{name}: {type(layer).__name__}: no halo (statistics over all slabs)" if layer.spatial_params else name
            )
            continue
        windows = layer.windows(n, ranks, axis)
        d = layer.axes[axis][0] - 2
        n_out = window_output_size(n, layer.kernel[d], layer.stride[d], layer.dilation[d], *layer.pad[d])
        lines.append(
            f"{name}: {layer.plain} k={layer.kernel[d]} s={layer.stride[d]} d={layer.dilation[d]} pad={layer.pad[d]} "
            f"{layer.mode}: {n} -> {n_out} rows"
        )
        for w in windows:
            lines.append(
                f"  rank {w.rank}: {_halo(w.top)}[{w.own[0]:>4}, {w.own[1]:>4}){_halo(w.bottom, after=True)}"
                f"  -> out [{w.out[0]}, {w.out[1]})"
            )
        lines.append(_bar(windows, n))
        n = n_out
    return "\n".join(lines)


def _halo(entries: list, after: bool = False) -> str:
    if not entries:
        return "      " if not after else ""
    kinds = {"fill": "pad", "own": "self", "peer": "r"}
    sources = sorted({kinds[k] + (str(a) if k == "peer" else "") for k, a, _ in entries})
    text = f"+{len(entries)}({','.join(sources)})"
    return f" {text}" if after else f"{text} "


def _bar(windows: list, n: int, width: int = 60) -> str:
    """Rows as characters: digits = owning rank; '^'/'v' under rows other ranks read as halo."""
    scale = max(1, -(-n // width))
    cells = [" "] * (-(-n // scale))
    for w in windows:
        for g in range(w.own[0], w.own[1]):
            cells[g // scale] = str(w.rank % 10)
    marks = [" "] * len(cells)
    for w in windows:
        for kind, q, row in w.top + w.bottom:
            if kind == "peer":
                marks[(windows[q].own[0] + row) // scale] = "^"
    return "  rows |" + "".join(cells) + "|\n  halo |" + "".join(marks) + "|"
