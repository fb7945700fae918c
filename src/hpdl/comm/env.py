"""Reading hpdl's settings from environment variables, with errors that name the variable.

The readers of the settings registry (`hpdl.settings`), under the names the communicators have always used:
every name must be registered there (type, default, doc), so `hpdl info --env` and docs/settings.md list it.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import hpdl.settings as settings

__all__ = ["env_flag", "env_number"]

N = TypeVar("N", int, float)


def env_flag(name: str, default: bool = False) -> bool:
    """A yes/no environment variable: 0, false, no, off (any case) or empty mean no."""
    return settings.flag(name, default)


def env_number(name: str, default: N, kind: Callable[[str], N], what: str, *, allow_zero: bool = False) -> N:
    """The positive (or, with `allow_zero`, non-negative) number in `name`; `default` when unset or empty."""
    return settings.number(name, default, kind, what, allow_zero=allow_zero)
