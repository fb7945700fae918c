"""The shared-memory files that MPI jobs killed before MPI_Finalize leave in /dev/shm, found and removed.

MPICH keeps each job's node segment as a file (`mpich_shm_<world id>_<node>`) until its ranks finalise. Ranks
that end otherwise (killed by a failure, a timeout, a test's teardown, `os._exit`) leave it behind: 2-3 MB per
job, held until the machine reboots, in a /dev/shm that is 64 MB in a default container. The test suite left
some 23 MB per run. `hpdl launch` removes its own jobs' files by name under MPICH's forking launcher
(spawn.remove_forker_segments); other launchers name a job's files after nothing the caller knows, so here a
file is a leftover when nothing can still use it:
- its name is one of MPICH's or Open MPI's segment names (`PATTERNS`), and this user owns it;
- no process maps it or holds it open (a running job's ranks map their segment until they finalise);
- it was last changed `settle` seconds before the look at /proc began: its creator, if it still runs, was
  there to be seen, holding the file open or mapped (it maps the file as soon as it has created it).

`python -m hpdl.runtime.shm_leftovers` removes them (safe beside running jobs); the test suite does at its end.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import time
from typing import Optional, Sequence

__all__ = ["PATTERNS", "SETTLE_SECONDS", "held", "in_use", "leftovers", "remove"]

SHM_DIR = "/dev/shm"
PATTERNS = ("mpich_shm_*", "mpich_vci_*", "vader_segment.*", "sm_segment.*")
"""MPICH's node segments (the files it creates; its windows' files are unlinked once mapped), and Open MPI's
per-rank segments of its shared-memory transport (`vader_segment.<host>.<uid>.<job>.<rank>` in 4.x,
`sm_segment.<host>...` in 5.x; 4-16 MB each, unlinked at finalize; its launcher removes a killed rank's, but they
stay when the launcher dies with the job)."""
SETTLE_SECONDS = 2.0


def in_use(root: str = SHM_DIR) -> set[str]:
    """The files under `root` that some process this user can see maps or holds open (from /proc)."""
    prefix = os.path.join(root, "")
    used: set[str] = set()
    try:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return used
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    at = line.find(prefix)
                    if at >= 0:
                        used.add(line[at:].rstrip("\n").removesuffix(" (deleted)"))
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # ended meanwhile, or another user's (who cannot open this user's 0600 files)
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(prefix):
                used.add(target)
    return used


def leftovers(root: str = SHM_DIR, since: Optional[float] = None, settle: float = SETTLE_SECONDS) -> list[str]:
    """This user's MPI segment files under `root` that nothing uses, last changed at or after `since` (a time
    from time.time(); None: any time) and at least `settle` seconds before this call."""
    try:
        names = [name for name in os.listdir(root) if any(fnmatch.fnmatch(name, p) for p in PATTERNS)]
    except OSError:
        return []  # no /dev/shm (not Linux): nothing is kept there
    now, uid = time.time(), os.getuid()
    candidates = []
    for name in names:
        path = os.path.join(root, name)
        try:
            stat = os.stat(path)
        except OSError:
            continue
        if stat.st_uid == uid and (since is None or stat.st_mtime >= since) and now - stat.st_mtime >= settle:
            candidates.append(path)
    if not candidates:
        return []
    used = in_use(root)
    return sorted(path for path in candidates if path not in used)


def held(paths: list[str]) -> int:
    """The bytes `paths` hold (a file gone meanwhile counts nothing)."""
    total = 0
    for path in paths:
        try:
            total += os.stat(path).st_size
        except OSError:
            pass
    return total


def remove(paths: list[str]) -> int:
    """Unlink `paths`; return the bytes they held (a file already gone counts nothing)."""
    freed = 0
    for path in paths:
        size = held([path])
        try:
            os.unlink(path)
        except OSError:
            continue
        freed += size
    return freed


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hpdl.runtime.shm_leftovers",
        description="Remove the MPI segment files that killed jobs left in /dev/shm (none that a process uses).",
    )
    parser.add_argument("--dry-run", action="store_true", help="list them, remove nothing")
    parser.add_argument("--settle", type=float, default=SETTLE_SECONDS, help="skip files younger than this (s)")
    args = parser.parse_args(argv)
    found = leftovers(settle=args.settle)
    for path in found:
        print(path)
    if args.dry_run:
        print(f"{len(found)} leftover MPI segment files in {SHM_DIR}")
    else:
        print(f"removed {len(found)} leftover MPI segment files ({remove(found) / 1e6:.1f} MB) from {SHM_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
