"""Ranks' stdout and stderr that go around MPICH's forking launcher instead of through it.

`mpiexec.gforker` copies each rank's output one `char` at a time and takes
`fputc`'s unsigned return for a failed write whenever the byte is above 127:
at the first non-ASCII character it closes that pipe, the rest of the rank's
output is lost, and its next write raises BrokenPipeError (seen as
`hpdl bench comm` failing in its final print of "µs"). So `hpdl launch`
hands every rank descriptors of its own, inherited through the launcher,
and the rank puts them in place of its fds 1 and 2 before it runs anything
(`adopt`, called by `hpdl.runtime.run_rank`).
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field
from typing import IO, Callable, MutableMapping, Optional

__all__ = ["RANK_OUTPUT_FDS", "RankOutputs", "adopt", "rank_outputs"]

RANK_OUTPUT_FDS = "HPDL_RANK_OUTPUT_FDS"
"""'out,err' for every rank, or 'out0,err0;out1,err1;...' one pair per rank (PMI_RANK picks)."""


@dataclass
class RankOutputs:
    """What a launch hands its ranks: the variable's value, the fds to pass (the launcher closes its copies once
    the job has started) and the threads that copy tagged lines."""

    value: str
    fds: tuple[int, ...]
    pumps: list[threading.Thread] = field(default_factory=list)


def rank_outputs(nprocs: int, tag: Optional[Callable[[IO[bytes], IO[str], int], None]]) -> RankOutputs:
    """Untagged: copies of our fds 1 and 2; tagged: a pipe pair per rank, read by `tag(source, sink, rank)`."""
    if tag is None:
        out, err = os.dup(1), os.dup(2)
        return RankOutputs(f"{out},{err}", (out, err))
    pairs, fds, pumps = [], [], []
    for rank in range(nprocs):
        ends = []
        for sink in (sys.stdout, sys.stderr):
            read, write = os.pipe()
            source = os.fdopen(read, "rb")
            pumps.append(threading.Thread(target=tag, args=(source, sink, rank), daemon=True))
            ends.append(write)
        pairs.append(f"{ends[0]},{ends[1]}")
        fds += ends
    for pump in pumps:
        pump.start()
    return RankOutputs(";".join(pairs), tuple(fds), pumps)


def adopt(env: MutableMapping[str, str] = os.environ) -> None:
    """In a rank: make the descriptors `hpdl launch` handed over this process's stdout and stderr."""
    value = env.pop(RANK_OUTPUT_FDS, "")
    if not value:
        return
    pairs = [tuple(int(fd) for fd in pair.split(",")) for pair in value.split(";")]
    out, err = pairs[int(env.get("PMI_RANK", "0")) if len(pairs) > 1 else 0]
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out, 1)
    os.dup2(err, 2)
    for fd in {fd for pair in pairs for fd in pair}:
        os.close(fd)
