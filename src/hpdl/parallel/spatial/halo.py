"""Halo exchange as autograd functions, forward and backward, overlapped with the interior computation.

    x2 = begin(x)            post the sends of my border rows and the receives of my halos
    interior = op(x2[...])   rows that need only my own input, computed while the halos fly
    top, bottom = end(x2)    wait; the halo rows (padding rows included), ready to concatenate

Backward runs the same in reverse: `end`'s backward sends the gradients of
the halo rows back to the ranks that own those rows and posts the receives
of the gradients of my rows that my neighbours used; the interior's
backward runs while they fly; `begin`'s backward waits and adds them into
my rows' gradient. Rows that are padding copies of my own rows (reflect,
replicate, circular at rank 0 / the last rank) get their gradient added
locally; constant padding rows get none.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from hpdl.comm.base import Communicator
from hpdl.parallel.spatial.partition import Window, even_split

__all__ = ["HaloStats", "halo_window_forward"]

FORWARD_TAG, BACKWARD_TAG = 7000, 7001
TAG_STRIDE = 2
INTERIOR_PIECES = 4
"""The interior is computed in this many row blocks, with the engine polled between them."""


@dataclass
class HaloStats:
    """Seconds spent by the halo exchange of one layer (or of a whole model, summed)."""

    exchanges: int = 0
    bytes_sent: int = 0
    wait_seconds: float = 0.0
    """Time blocked waiting for halos after the interior was computed (what overlap did not hide)."""
    interior_seconds: float = 0.0
    """Time computing the interior between posting and waiting (what hides the transfer)."""
    layers: dict[str, HaloStats] = field(default_factory=dict)

    def add(self, other: HaloStats) -> None:
        self.exchanges += other.exchanges
        self.bytes_sent += other.bytes_sent
        self.wait_seconds += other.wait_seconds
        self.interior_seconds += other.interior_seconds


class _Exchange:
    """The messages of one call of one layer: what to send to / receive from each neighbour, and the handles."""

    def __init__(self, comm: Communicator, windows: list[Window], dim: int, tag: int, stats: HaloStats):
        self.comm, self.dim, self.tag, self.stats = comm, dim, tag, stats
        me = comm.rank
        self.window = windows[me]
        self.receive_rows = self.window.peers()  # q -> q's local rows I get
        self.send_rows = {q: w.peers()[me] for q, w in enumerate(windows) if q != me and me in w.peers()}
        self.works: list[Any] = []
        self.received: dict[int, torch.Tensor] = {}
        self.grad_works: list[Any] = []
        self.grad_received: dict[int, torch.Tensor] = {}
        self.backward_posted = False
        self.fill = 0.0

    def _rows_shape(self, x: torch.Tensor, rows: int) -> list[int]:
        shape = list(x.shape)
        shape[self.dim] = rows
        return shape

    def post_forward(self, x: torch.Tensor) -> None:
        for q, rows in self.receive_rows.items():
            buf = x.new_empty(self._rows_shape(x, len(rows)))
            self.received[q] = buf
            self.works.append(self.comm.recv(buf, q, tag=self.tag, async_op=True))
        for q, rows in self.send_rows.items():
            index = torch.tensor(rows, dtype=torch.long, device=x.device)
            payload = x.index_select(self.dim, index).contiguous()
            self.stats.bytes_sent += payload.numel() * payload.element_size()
            self.works.append(self.comm.send(payload, q, tag=self.tag, async_op=True))
        self.stats.exchanges += 1

    def poke(self) -> None:
        """Let the engine advance the transfers in flight (a test of each, no waiting)."""
        for work in self.works:
            work.is_completed()

    def wait(self, works: list[Any]) -> None:
        started = time.perf_counter()
        for work in works:
            work.wait()
        works.clear()
        self.stats.wait_seconds += time.perf_counter() - started

    def assemble(self, x: torch.Tensor, entries: list[tuple[str, int, int]]) -> torch.Tensor:
        """The halo rows `entries` (in order) as one tensor along `dim`."""
        if not entries:
            return x.new_empty(self._rows_shape(x, 0))
        rows = []
        for kind, a, b in entries:
            if kind == "fill":
                rows.append(x.new_full(self._rows_shape(x, 1), self.fill))
            elif kind == "own":
                rows.append(x.narrow(self.dim, a, 1))
            else:
                position = self.receive_rows[a].index(b)
                rows.append(self.received[a].narrow(self.dim, position, 1))
        return torch.cat(rows, self.dim)

    def post_backward(
        self, x_shape: list[int], like: torch.Tensor, grads: list[tuple[list, Any]]
    ) -> Optional[torch.Tensor]:
        """Send the halo rows' gradients to their owners and post receives; return my padding copies' gradient."""
        self.backward_posted = True
        outgoing = {q: like.new_zeros(self._rows_shape(like, len(rows))) for q, rows in self.receive_rows.items()}
        own: Optional[torch.Tensor] = None
        for entries, grad in grads:
            for i, (kind, a, b) in enumerate(entries):
                row = grad.narrow(self.dim, i, 1)
                if kind == "peer":
                    outgoing[a].narrow(self.dim, self.receive_rows[a].index(b), 1).add_(row)
                elif kind == "own":
                    if own is None:
                        own = like.new_zeros(x_shape)
                    own.narrow(self.dim, a, 1).add_(row)
        for q, rows in self.send_rows.items():
            buf = like.new_empty(self._rows_shape(like, len(rows)))
            self.grad_received[q] = buf
            self.grad_works.append(self.comm.recv(buf, q, tag=self.tag + 1, async_op=True))
        for q, payload in outgoing.items():
            self.grad_works.append(self.comm.send(payload, q, tag=self.tag + 1, async_op=True))
        return own


class _Begin(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, exchange: _Exchange) -> torch.Tensor:
        ctx.exchange = exchange
        exchange.post_forward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        exchange: _Exchange = ctx.exchange
        if not exchange.backward_posted:
            # no output of mine read a halo row (autograd skipped `end`), but neighbours may have read my rows
            exchange.post_backward(list(grad.shape), grad, [])
        exchange.wait(exchange.grad_works)
        if not exchange.grad_received:
            return grad, None
        grad = grad.clone()
        for q, received in exchange.grad_received.items():
            index = torch.tensor(exchange.send_rows[q], dtype=torch.long, device=grad.device)
            grad.index_add_(exchange.dim, index, received)
        exchange.grad_received.clear()
        return grad, None


class _End(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, exchange: _Exchange) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.exchange = exchange
        ctx.x_shape = list(x.shape)
        exchange.wait(exchange.works)
        top = exchange.assemble(x, exchange.window.top)
        bottom = exchange.assemble(x, exchange.window.bottom)
        exchange.received.clear()
        return top, bottom

    @staticmethod
    def backward(ctx: Any, grad_top: Optional[torch.Tensor], grad_bottom: Optional[torch.Tensor]) -> tuple[Any, None]:
        exchange: _Exchange = ctx.exchange
        window = exchange.window
        like = grad_top if grad_top is not None else grad_bottom
        assert like is not None  # autograd calls backward only when some output has a gradient
        grads = []
        for entries, grad in ((window.top, grad_top), (window.bottom, grad_bottom)):
            if grad is not None and entries:
                grads.append((entries, grad))
        own = exchange.post_backward(ctx.x_shape, like, grads)
        return own, None


class _Rows(torch.autograd.Function):
    """Row ranges of one tensor as views; backward adds their gradients into one buffer.

    The interior pieces and the border parts each read a range of my own rows; through `narrow`, autograd
    would allocate and zero a gradient of the whole slab per range and add them all up (six whole-slab fills
    and adds per layer, a quarter of a step's time on a high-resolution image).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, ranges: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
        ctx.dim, ctx.ranges, ctx.shape = dim, ranges, x.shape
        return tuple(x.narrow(dim, start, rows) for start, rows in ranges)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], None, None]:
        present = [g for g in grads if g is not None]
        if not present:
            return None, None, None
        out = present[0].new_zeros(ctx.shape)
        for (start, rows), g in zip(ctx.ranges, grads):
            if g is not None:
                out.narrow(ctx.dim, start, rows).add_(g)
        return out, None, None


def halo_window_forward(
    x: torch.Tensor,
    comm: Communicator,
    windows: list[Window],
    *,
    dim: int,
    kernel_span: int,
    stride: int,
    op: Callable[[torch.Tensor], torch.Tensor],
    tag: int,
    stats: HaloStats,
    fill: float = 0.0,
    overlap: bool = True,
) -> torch.Tensor:
    """This rank's output slab of the sliding-window `op` (split dim unpadded) over the global input.

    `op` maps rows [e0, e1) of the extended input (halo, own rows, halo)
    to output rows; the interior rows, which read only own rows, are
    computed from a view of `x` while the halos are in flight.
    """
    w = windows[comm.rank]
    exchange = _Exchange(comm, windows, dim, tag, stats)
    exchange.fill = fill
    i0, i1 = w.own
    first = w.need[0]
    n_top = max(0, i0 - first)  # halo rows before my own rows
    own_offset = max(0, first - i0)  # my own rows the outputs skip (stride larger than my border)
    used0, used1 = w.own_used
    n_used = used1 - used0
    n_out = w.rows_out

    # interior output rows j: j*stride >= n_top and j*stride + span <= n_top + n_used
    j_top = min(n_out, -(-n_top // stride))
    j_bottom = min(n_out, max(0, (n_top + n_used - kernel_span) // stride + 1))
    interior_rows = j_bottom - j_top if overlap else 0
    interior = [
        (own_offset + (j_top + j0) * stride - n_top, (j1 - j0 - 1) * stride + kernel_span)
        for j0, j1 in (even_split(interior_rows, min(INTERIOR_PIECES, interior_rows)) if interior_rows > 0 else [])
    ]
    # the border parts, as rows [e0, e1) of cat(top halo, own used rows, bottom halo)
    if interior:
        spans = []
        if j_top > 0:
            spans.append((0, (j_top - 1) * stride + kernel_span))
        if j_bottom < n_out:
            spans.append((j_bottom * stride, (n_out - 1) * stride + kernel_span))
    else:
        spans = [(0, (n_out - 1) * stride + kernel_span)]
    own_parts = [(max(e0, n_top), min(e1, n_top + n_used)) for e0, e1 in spans]
    own_ranges = [(own_offset + a - n_top, b - a) for a, b in own_parts if a < b]

    x2 = _Begin.apply(x, exchange)
    views = list(_Rows.apply(x2, dim, interior + own_ranges))
    interior_views, own_views = views[: len(interior)], iter(views[len(interior) :])

    def extended(e0: int, e1: int, top: torch.Tensor, bottom: torch.Tensor) -> torch.Tensor:
        """Rows [e0, e1) of cat(top, own used rows, bottom), as a view where they are all own rows."""
        pieces = []
        if e0 < n_top:
            pieces.append(top.narrow(dim, e0, min(e1, n_top) - e0))
        if max(e0, n_top) < min(e1, n_top + n_used):
            pieces.append(next(own_views))
        a, b = max(e0, n_top + n_used), e1
        if a < b:
            pieces.append(bottom.narrow(dim, a - n_top - n_used, b - a))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)

    done = None
    if interior:
        started = time.perf_counter()
        outputs = []
        for piece in interior_views:
            outputs.append(op(piece))
            exchange.poke()  # MPI moves a large message only inside a call: let it advance between pieces
        done = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim)
        stats.interior_seconds += time.perf_counter() - started
    top, bottom = _End.apply(x2, exchange)
    if done is None:
        return op(extended(*spans[0], top, bottom))
    parts = []
    if j_top > 0:
        parts.append(op(extended(*spans[0], top, bottom)))
    parts.append(done)
    if j_bottom < n_out:
        parts.append(op(extended(*spans[-1], top, bottom)))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)
