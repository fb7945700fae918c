"""Argument types every benchmark's command line uses."""

from __future__ import annotations

import argparse
from typing import Any, Callable

__all__ = ["positive"]


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: `kind(text)`, refused with a clear message unless it is a positive number."""

    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be positive")
        return value

    return convert
