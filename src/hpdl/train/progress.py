"""A progress bar for training: loss, samples/s and ETA, on one rank only.

On a terminal `tqdm` draws it (one redrawn line, at most ten times a
second); otherwise (a log file, a pipe, CI) a plain line is printed every
`every` steps and at the end, so logs stay readable and hold no `\\r`. This
helper and `logging` are the only ways `hpdl.train` writes to the terminal.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any, Optional

from tqdm import tqdm

__all__ = ["Progress", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """'7s', '2m05s', '1h02m'."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds + 0.5), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class _Bar(tqdm):  # type: ignore[misc]
    """tqdm with one more field for `bar_format`: `{stats}`, our loss, samples/s and ETA (tqdm's own postfix
    would add a comma, and its rate counts steps, not samples)."""

    stats = ""
    monitor_interval = 0  # no monitor thread in a rank's process: our own updates redraw the bar

    @property
    def format_dict(self) -> dict[str, Any]:
        return {**super().format_dict, "stats": self.stats}


class Progress:
    """One bar per epoch: `update(samples, loss)` after each step, `close(summary)` at the end.

    total: steps in the epoch. enabled: False makes every call a no-op (the
    ranks other than 0). stream: default stdout. every: steps between plain
    lines when the stream is not a terminal (default: a line at most every
    `interval` seconds, so a fast epoch logs one line and a slow one a few).
    """

    def __init__(
        self,
        total: int,
        *,
        desc: str = "",
        enabled: bool = True,
        stream: Optional[IO[str]] = None,
        every: Optional[int] = None,
        width: int = 24,
        interval: float = 10.0,
    ) -> None:
        self.total = max(0, total)
        self.desc = desc
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stdout
        self.tty = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every
        self.interval = interval
        self.steps = 0
        self.samples = 0
        self.loss: Optional[float] = None
        self.start = time.perf_counter()
        self._last_line = self.start
        self._bar: Optional[_Bar] = None
        if self.tty:
            shape = f"  [{{bar:{width}}}]" if self.total else ""
            self._bar = _Bar(
                total=self.total or None,
                desc=desc,
                file=self.stream,
                bar_format="{desc}" + shape + "  {stats}",
                ascii=".#",
                mininterval=0.1,
                delay=1e-9,  # nothing drawn before the first step
                leave=True,
            )

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def rate(self) -> float:
        """Samples per second since the bar started."""
        return self.samples / self.elapsed if self.elapsed > 0 else 0.0

    def update(self, samples: int, loss: Optional[float] = None) -> None:
        self.steps += 1
        self.samples += samples
        if loss is not None:
            self.loss = loss
        if self._bar is not None:
            self._bar.stats = self._stats()
            self._bar.update(self.steps - self._bar.n)  # a resumed epoch's bar starts part-way (`steps` set)
        elif self.enabled and self.steps != self.total:
            now = time.perf_counter()
            due = self.steps % self.every == 0 if self.every else now - self._last_line >= self.interval
            if due:
                self._last_line = now
                self.write(self.line())

    def _stats(self) -> str:
        eta = (self.total - self.steps) * self.elapsed / self.steps if self.steps else 0.0
        parts = [f"{self.steps}/{self.total}"]
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        parts.append(f"{self.rate:,.0f} samples/s")
        parts.append(f"ETA {format_seconds(eta)}" if self.steps < self.total else f"in {format_seconds(self.elapsed)}")
        return "  ".join(parts)

    def line(self) -> str:
        """The bar's state as one plain line: 'epoch 1/3  2/4  loss 0.5000  1,234 samples/s  ETA 1.2s'."""
        return "  ".join([self.desc, self._stats()] if self.desc else [self._stats()])

    def close(self, summary: str = "") -> None:
        """End the bar with its final state and `summary` (for example the evaluation)."""
        if self._bar is not None:
            self._bar.n = self.steps
            self._bar.stats = self._stats() + (f"  {summary}" if summary else "")
            self._bar.close()
        elif self.enabled:
            self.write(self.line() + (f"  {summary}" if summary else ""))

    def write(self, text: str) -> None:
        """Print one line (between bars)."""
        if self.enabled:
            self.stream.write(text + "\n")
            self.stream.flush()
