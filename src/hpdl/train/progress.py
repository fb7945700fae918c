"""A progress bar for training: loss, samples/s and ETA, on one rank only.

On a terminal it redraws one line (`\\r`); otherwise (a log file, a pipe,
CI) it prints a plain line every `every` steps and at the end, so logs stay
readable. This helper and `logging` are the only ways `hpdl.train` writes
to the terminal.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Optional

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
        self.width = width
        self.steps = 0
        self.samples = 0
        self.loss: Optional[float] = None
        self.start = time.perf_counter()
        self._last_draw = 0.0

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
        if not self.enabled:
            return
        if self.tty:
            now = time.perf_counter()
            if now - self._last_draw >= 0.1 or self.steps == self.total:
                self._last_draw = now
                self.stream.write("\r" + self.line() + "\x1b[K")
                self.stream.flush()
        elif self.steps != self.total:
            now = time.perf_counter()
            due = (
                self.steps % self.every == 0 if self.every else now - max(self._last_draw, self.start) >= self.interval
            )
            if due:
                self._last_draw = now
                self.stream.write(self.line() + "\n")
                self.stream.flush()

    def line(self) -> str:
        eta = (self.total - self.steps) * self.elapsed / self.steps if self.steps else 0.0
        parts = [self.desc] if self.desc else []
        if self.tty and self.total:
            filled = int(self.width * self.steps / self.total)
            parts.append("[" + "#" * filled + "." * (self.width - filled) + "]")
        parts.append(f"{self.steps}/{self.total}")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        parts.append(f"{self.rate:,.0f} samples/s")
        parts.append(f"ETA {format_seconds(eta)}" if self.steps < self.total else f"in {format_seconds(self.elapsed)}")
        return "  ".join(parts)

    def close(self, summary: str = "") -> None:
        """End the bar with its final state and `summary` (for example the evaluation)."""
        if not self.enabled:
            return
        text = self.line() + (f"  {summary}" if summary else "")
        self.stream.write(("\r" + text + "\x1b[K\n") if self.tty else text + "\n")
        self.stream.flush()

    def write(self, text: str) -> None:
        """Print one line (between bars)."""
        if self.enabled:
            self.stream.write(text + "\n")
            self.stream.flush()
