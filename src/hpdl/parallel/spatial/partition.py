"""Which global rows each rank owns, and which input rows each rank's output slab needs (pure arithmetic).

Every activation is split along one dimension into contiguous slabs, the
first `n % p` ranks one row longer (`even_split`). A sliding-window layer
(convolution, pooling) with kernel `k`, stride `s`, dilation `d` and
padding `lo`/`hi` along that dimension computes, on each rank, the global
output rows that the even split of the *global* output size gives it, and
needs the input rows [start*s - lo, (end-1)*s - lo + d*(k-1)]. Rows outside
the image are padding: a constant (zeros, -inf for max pooling) or another
row of the image (reflect, replicate, circular). Rows that another rank
owns arrive as a halo. Every rank computes every rank's window from the
global sizes alone, so nothing about sizes is exchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["even_split", "window_output_size", "Window", "plan_windows", "PADDING_MODES"]

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def even_split(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of each of `parts` contiguous slabs of `n` rows, the first n % parts one row longer."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for r in range(parts):
        end = start + base + (1 if r < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def window_output_size(n: int, kernel: int, stride: int, dilation: int, pad_lo: int, pad_hi: int) -> int:
    """Output rows of a sliding window over `n` input rows (floor mode, as torch's conv and pooling)."""
    span = dilation * (kernel - 1) + 1
    return (n + pad_lo + pad_hi - span) // stride + 1


def padding_source(g: int, n: int, mode: str) -> Optional[int]:
    """The image row that padding row `g` (outside [0, n)) copies, or None for a constant row."""
    if 0 <= g < n:
        return g
    if mode == "zeros":
        return None
    if mode == "replicate":
        return min(max(g, 0), n - 1)
    if mode == "circular":
        return g % n
    if mode == "reflect":
        source = -g if g < 0 else 2 * (n - 1) - g
        if not 0 <= source < n:
            raise ValueError(f"reflect padding of {max(-g, g - n + 1)} rows needs more than {n} rows of input")
        return source
    raise ValueError(f"padding mode {mode!r} is not one of {PADDING_MODES}")


@dataclass
class Window:
    """One rank's part of a sliding-window layer along the split dimension (global row numbers)."""

    rank: int
    own: tuple[int, int]
    """[start, end) of the input rows this rank holds."""
    out: tuple[int, int]
    """[start, end) of the output rows this rank computes."""
    need: tuple[int, int]
    """[first, last + 1) of the input rows (padding included) those outputs read."""
    top: list[tuple[str, int, int]] = field(default_factory=list)
    """Rows before `own`: ("fill", 0, 0), ("own", local row, 0) or ("peer", rank, local row at that rank)."""
    bottom: list[tuple[str, int, int]] = field(default_factory=list)
    """Rows after `own`, as `top`."""

    @property
    def rows_out(self) -> int:
        return self.out[1] - self.out[0]

    @property
    def own_used(self) -> tuple[int, int]:
        """[start, end) of the rows of `own` that the outputs read."""
        return max(self.need[0], self.own[0]), min(self.need[1], self.own[1])

    def peers(self) -> dict[int, list[int]]:
        """Rank -> the sorted local rows of that rank this rank receives (its halo's sources)."""
        wanted: dict[int, set[int]] = {}
        for kind, a, b in self.top + self.bottom:
            if kind == "peer":
                wanted.setdefault(a, set()).add(b)
        return {q: sorted(rows) for q, rows in sorted(wanted.items())}


def plan_windows(
    n_in: int,
    parts: int,
    *,
    kernel: int,
    stride: int,
    dilation: int,
    pad_lo: int,
    pad_hi: int,
    mode: str,
    layer: str,
) -> list[Window]:
    """Every rank's `Window` for a layer over an input of `n_in` rows split evenly in `parts` slabs.

    Raises ValueError, naming `layer` and the smallest slab that works,
    where a rank would have no output rows, read none of its own rows, or
    need rows of a rank that is not its neighbour (a slab thinner than the
    halo).
    """
    if mode not in PADDING_MODES:
        raise ValueError(f"{layer}: padding mode {mode!r} is not one of {PADDING_MODES}")
    span = dilation * (kernel - 1) + 1
    n_out = window_output_size(n_in, kernel, stride, dilation, pad_lo, pad_hi)
    if n_out < parts:
        raise ValueError(
            f"{layer}: its output has {max(n_out, 0)} rows along the split dimension, fewer than the {parts} "
            f"ranks; every rank needs at least one: use fewer ranks or a larger input"
        )
    owns, outs = even_split(n_in, parts), even_split(n_out, parts)
    halo = max(pad_lo, span - 1 - pad_lo, 1)
    windows = []
    for r in range(parts):
        o0, o1 = outs[r]
        first, last = o0 * stride - pad_lo, (o1 - 1) * stride - pad_lo + span - 1
        w = Window(r, owns[r], outs[r], (first, last + 1))
        i0, i1 = owns[r]
        used = w.own_used
        if used[0] >= used[1]:
            raise _thin(layer, r, i1 - i0, halo, n_in, parts)
        for g in list(range(first, min(i0, last + 1))) + list(range(max(i1, first), last + 1)):
            source = padding_source(g, n_in, mode)
            if source is None:
                entry = ("fill", 0, 0)
            elif i0 <= source < i1:
                entry = ("own", source - i0, 0)
            else:
                q = next(q for q, (s0, s1) in enumerate(owns) if s0 <= source < s1)
                neighbours = {(r - 1) % parts, (r + 1) % parts} if mode == "circular" else {r - 1, r + 1}
                if q not in neighbours:
                    raise _thin(layer, r, i1 - i0, halo, n_in, parts)
                entry = ("peer", q, source - owns[q][0])
            (w.top if g < i0 else w.bottom).append(entry)
        windows.append(w)
    return windows


def _thin(layer: str, rank: int, rows: int, halo: int, n_in: int, parts: int) -> ValueError:
    return ValueError(
        f"{layer}: rank {rank}'s slab of {rows} rows (of {n_in} over {parts} ranks) is thinner than the halo this "
        f"layer needs; the smallest slab it supports is {halo} rows (an input of at least {halo * parts} rows): "
        f"use fewer ranks or a larger input"
    )
