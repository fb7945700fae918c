"""`env://` under an MPI launcher: rank 0 opens a TCPStore on a free port and tells the others over MPI.

torch.distributed needs a store even when the collectives do not (new gloo
groups, DeviceMesh and the store-based barriers use it). Rank and world size
come from MPI; a rank or world size given in the URL must agree with them.
"""

from __future__ import annotations

import datetime
from typing import Any, Iterator, Optional
from urllib.parse import parse_qs, urlparse

__all__ = ["mpi_rendezvous"]

DEFAULT_STORE_TIMEOUT = datetime.timedelta(minutes=30)


def mpi_rendezvous(url: str, timeout: Optional[datetime.timedelta]) -> Iterator[tuple[Any, int, int]]:
    import hpdl
    from hpdl.runtime.store import open_store_over_mpi

    comm = hpdl.init("mpi")
    query = {k: v[-1] for k, v in parse_qs(urlparse(url).query).items()}
    for name, mine in (("rank", comm.rank), ("world_size", comm.size)):
        if name in query and int(query[name]) != mine:
            raise ValueError(
                f"init_process_group: {name}={query[name]} but MPI says {mine} (this process is rank {comm.rank} "
                f"of {comm.size}); under an MPI launcher leave rank and world_size out (or pass MPI's values)"
            )
    span = timeout or DEFAULT_STORE_TIMEOUT
    # rank 0's server listens on loopback for a job on one machine, else on the address of its host that every
    # rank reaches (agreed over MPI: hpdl.runtime.addresses)
    store = open_store_over_mpi(
        lambda value: comm.broadcast_object(value, root=0), comm.allgather_object, comm.rank, comm.size, span,
        "init_process_group",
    )  # fmt: skip
    yield store, comm.rank, comm.size
    raise RuntimeError("the hpdl MPI rendezvous cannot re-rendezvous: restart the job")
