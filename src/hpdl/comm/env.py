"""Reading hpdl's settings from environment variables, with errors that name the variable."""

from __future__ import annotations

import os
from typing import Callable, TypeVar

__all__ = ["env_flag", "env_number"]

N = TypeVar("N", int, float)


def env_flag(name: str, default: bool = False) -> bool:
    """A yes/no environment variable: 0, false, no, off (any case) or empty mean no."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def env_number(name: str, default: N, kind: Callable[[str], N], what: str, *, allow_zero: bool = False) -> N:
    """The positive (or, with `allow_zero`, non-negative) number in `name`; `default` when unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} must be {what}") from None
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name}={text!r} must be {'non-negative' if allow_zero else 'positive'}")
    return value
