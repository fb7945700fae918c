"""Peak resident memory of one call, from the process's high-water mark (Linux).

Writing 5 to /proc/self/clear_refs resets the high-water mark (VmHWM) to the
current resident set (Linux 4.0 and later), so the mark after a call minus
the resident set before it is what the call added at its peak, even if it
freed it again before returning: what a second process would have to find
free. Contenders that share one process can be compared this way, one call
each, as long as each call allocates what it needs afresh.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["peak_increase"]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"no {field} in /proc/self/status")


def peak_increase(call: Callable[[], Any]) -> Optional[int]:
    """Bytes by which `call()` raised the resident set at its peak; None where the mark cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        before = _status_kib("VmRSS")
    except OSError:  # not Linux, or not allowed to reset the mark
        call()
        return None
    call()
    return (_status_kib("VmHWM") - before) * 1024
