"""A benchmark report's '## Targets' lines, each checked against the numbers it states.

Every target line is `- PASS ...`, `- MISS ...` or `- n/a ...: why`, and names its measured value and its target:
`1.23x ... (target >= 1.2x)`, `... 1.05x DDP (never below 1.0x)`, `bubble 0.120 vs formula 0.111 (target <=
0.122; ...)`. A test that only looked for "PASS" or "MISS" in the report passed whatever the numbers were; here a
line whose verdict is not the one its numbers earn fails, and so does a missing or extra line.
"""

from __future__ import annotations

import re

__all__ = ["checked_targets"]

_AT_LEAST = re.compile(r"(\d+(?:\.\d+)?)x\b.*\((?:target >= |never below )(\d+(?:\.\d+)?)x?[),]")
_AT_MOST = re.compile(r"(\d+\.\d+) vs formula [\d.]+ \(target <= (\d+\.\d+)")
_RATIO_AT_MOST = re.compile(r"(\d+(?:\.\d+)?)x\b[^(]*\(target <= (\d+(?:\.\d+)?)x\)")
"""`... 0.50x fsdp2-gloo's (target <= 1.0x)`: a ratio that must stay below its target (memory, bubble)."""
_ROUNDING = 0.006
"""Values are printed with 2 or 3 decimals and judged unrounded: a value this close to its target is not judged."""


def checked_targets(markdown: str) -> list[str]:
    """The report's target lines (without '- '), each with a verdict consistent with its numbers."""
    assert "## Targets" in markdown, markdown
    section = markdown.split("## Targets", 1)[1]
    lines = [line[2:] for line in section.splitlines() if line.startswith("- ")]
    for line in lines:
        verdict = line.split(" ", 1)[0]
        assert verdict in ("PASS", "MISS", "n/a"), line
        if verdict == "n/a":
            assert ": no " in line, line  # says what was missing
            continue
        at_least, at_most = _AT_LEAST.search(line), _AT_MOST.search(line) or _RATIO_AT_MOST.search(line)
        assert at_least or at_most, f"a target line names no measured value and target: {line}"
        value, target = (float(g) for g in (at_least or at_most).groups())  # type: ignore[union-attr]
        if abs(value - target) < _ROUNDING:
            continue
        met = value >= target if at_least else value <= target
        assert verdict == ("PASS" if met else "MISS"), line
    return lines
