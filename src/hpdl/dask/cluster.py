"""A Dask cluster made of the ranks of one MPI job (the model of dask-mpi, on the mpi:// transport).

Collective: every rank calls `run_cluster` (or `initialize`). Rank 0 runs the
scheduler, rank 1 the client (your code), every other rank a worker; all
three talk over mpi:// (or, as a control, tcp://). The scheduler's address
reaches the other ranks with an MPI broadcast. When the client's code ends,
normally or with an exception, the client shuts the cluster down and every
rank returns; when a rank dies, mpiexec ends the job (MPI cannot carry on
without a rank), so nothing hangs.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import sys
import time
from typing import Any, Callable, Optional, TypeVar

import hpdl.settings as settings

__all__ = ["ClusterOptions", "initialize", "run_cluster"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
SCHEDULER, CLIENT = 0, 1
PROTOCOLS = ("mpi", "tcp")


class ClusterOptions:
    """How the ranks start their Dask roles (validated; shared by `run_cluster`, `initialize` and `hpdl dask`)."""

    def __init__(
        self,
        *,
        protocol: str = "mpi",
        nthreads: int = 1,
        memory_limit: Any = "auto",
        local_directory: Optional[str] = None,
        dashboard: bool = False,
        timeout: float = 120.0,
        worker_options: Optional[dict[str, Any]] = None,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol {protocol!r}: choose one of {', '.join(PROTOCOLS)}")
        if nthreads < 1:
            raise ValueError(f"nthreads={nthreads}: need at least 1 thread per worker")
        if timeout <= 0:
            raise ValueError(f"timeout={timeout}: must be positive (seconds)")
        self.protocol = protocol
        self.nthreads = nthreads
        self.memory_limit = memory_limit
        self.local_directory = local_directory
        self.dashboard = dashboard
        self.timeout = timeout
        self.tcp_host: Optional[str] = None  # set when the ranks start (see _agree_on_hosts)
        self.worker_options = dict(worker_options or {})


def _world() -> Any:
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _collective(options: ClusterOptions, fn: Callable[[], T]) -> T:
    """Run an MPI collective where the transport can run it safely: on its progress thread when mpi:// is on."""
    if options.protocol == "mpi":
        from hpdl.dask.connection import get_hub

        return get_hub().progress.call(fn, timeout=options.timeout)
    return fn()


def _check_size(size: int, needs_client: bool) -> None:
    least = 3 if needs_client else 2
    if size < least:
        roles = "a scheduler, a client and at least one worker" if needs_client else "a scheduler and a worker"
        raise ValueError(f"a Dask cluster on MPI needs {least}+ ranks ({roles}); got {size}: use mpiexec -n {least}")


def _agree_on_hosts(options: ClusterOptions) -> None:
    """Every rank, before its Dask role: the mpi:// hub learns the ranks' hosts, tcp:// its listeners' host."""
    if options.protocol != "mpi":
        options.tcp_host = _tcp_host(_world())
        return
    from hpdl.dask.connection import get_hub

    hub = get_hub()
    hub.set_hosts(_collective(options, lambda: _world().allgather(hub.hostname)))


def _tcp_host(world: Any) -> Optional[str]:
    """Where this rank's tcp:// listener binds (collective): loopback when every rank is on this machine (no one
    off it has a reason to connect); across hosts the scheduler an address of its that every rank reaches (or
    HPDL_BIND_ADDR: hpdl.runtime.addresses, never a host name's lookup), and each other rank its own address on
    the route toward it."""
    from hpdl.runtime.addresses import LOOPBACK, agree_address, route_source

    agreed = agree_address(lambda value: world.bcast(value, root=SCHEDULER), world.allgather, world.rank, "hpdl dask")
    if world.rank == SCHEDULER or agreed == LOOPBACK:
        return agreed
    return route_source(agreed)


async def _scheduler(options: ClusterOptions, scheduler_file: Optional[str]) -> None:
    from distributed import Scheduler

    from hpdl.dask.shutdown import WorkersLeaveFirst

    world = _world()
    protocols = [options.protocol] + (["tcp"] if scheduler_file and options.protocol != "tcp" else [])
    # a scheduler file is for clients outside the job, maybe on another machine: its tcp:// listener is not loopback
    tcp_host = settings.text("HPDL_BIND_ADDR") if scheduler_file else options.tcp_host
    hosts = [tcp_host if protocol == "tcp" else None for protocol in protocols]
    # the HTTP server runs even without the dashboard: then on a free loopback port (no one needs to reach it)
    kwargs: dict[str, Any] = {
        "dashboard": options.dashboard,
        "dashboard_address": ":8787" if options.dashboard else "127.0.0.1:0",
        "protocol": protocols if len(protocols) > 1 else protocols[0],  # a list: one listener per protocol
        "host": hosts if len(hosts) > 1 else hosts[0],
    }
    async with Scheduler(**kwargs) as scheduler:
        scheduler.add_plugin(WorkersLeaveFirst(scheduler, options.timeout))  # at close: workers leave first
        addresses = [listener.contact_address for listener in scheduler.listeners]
        if scheduler_file:
            _write_scheduler_file(scheduler_file, scheduler, addresses)
        await asyncio.get_running_loop().run_in_executor(
            None, _collective, options, lambda: world.bcast(addresses[0], root=SCHEDULER)
        )
        await scheduler.finished()


def _write_scheduler_file(path: str, scheduler: Any, addresses: list[str]) -> None:
    """Dask's scheduler file, with a tcp:// address that clients outside the MPI job can reach."""
    identity = dict(scheduler.identity())
    outside = [a for a in addresses if a.startswith("tcp://")]
    identity["address"] = outside[0] if outside else addresses[0]
    identity["mpi_address"] = addresses[0]
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as handle:
        json.dump(identity, handle, indent=2)
    os.replace(tmp, path)


async def _worker(options: ClusterOptions, address: str, rank: int) -> None:
    from hpdl.dask.shutdown import Worker  # distributed's, leaving without cutting a heartbeat off

    kwargs: dict[str, Any] = {
        "name": f"rank-{rank}",
        "nthreads": options.nthreads,
        "memory_limit": options.memory_limit,
        "protocol": options.protocol,
        "dashboard": options.dashboard,
        "death_timeout": options.timeout,
    }
    if options.protocol == "tcp" and options.tcp_host:
        kwargs["host"] = options.tcp_host
    if not options.dashboard:  # its HTTP server runs anyway: on loopback
        kwargs["dashboard_address"] = "127.0.0.1:0"
    if options.local_directory:
        kwargs["local_directory"] = options.local_directory
    kwargs.update(options.worker_options)
    async with Worker(address, **kwargs) as worker:
        await worker.finished()


def _scheduler_address(options: ClusterOptions) -> str:
    return str(_collective(options, lambda: _world().bcast(None, root=SCHEDULER)))


def run_cluster(
    main: Optional[Callable[[Any], T]] = None,
    options: Optional[ClusterOptions] = None,
    *,
    scheduler_file: Optional[str] = None,
    **kwargs: Any,
) -> Optional[T]:
    """Run a Dask cluster on every rank of the job; rank 1 calls `main(client)`; return its result there.

    Collective (every rank calls it). With `main=None` rank 1 is a worker too
    and the cluster runs until a client shuts it down (see `scheduler_file`,
    which is written with a tcp:// address for clients outside the job).
    Every rank returns once the cluster has shut down; `main`'s result on
    rank 1, None elsewhere. An exception in `main` shuts the cluster down
    and is raised again on rank 1.
    """
    options = options or ClusterOptions(**kwargs)
    import hpdl.dask.transport  # noqa: F401 - registers the mpi:// scheme

    world = _world()
    rank, size = world.Get_rank(), world.Get_size()
    _check_size(size, main is not None)
    _agree_on_hosts(options)
    try:
        if rank == SCHEDULER:
            asyncio.run(_scheduler(options, scheduler_file))
            return None
        address = _scheduler_address(options)
        if rank == CLIENT and main is not None:
            return _run_client(main, address, options)
        asyncio.run(_worker(options, address, rank))
        return None
    finally:
        _final_barrier(options)


def _final_barrier(options: ClusterOptions) -> None:
    """Leave together: no rank finalises MPI while a peer is still shutting its Dask side down (sleeps, no spin)."""
    world = _world()
    run = _progress_call(options)
    request = run(world.Ibarrier)
    deadline = time.monotonic() + options.timeout
    while not run(request.Test):
        if time.monotonic() > deadline:
            raise TimeoutError(f"hpdl.dask: ranks still busy {options.timeout:g} s after the cluster shut down")
        time.sleep(0.005)


def _progress_call(options: ClusterOptions) -> Callable[[Callable[[], Any]], Any]:
    if options.protocol == "mpi":
        from hpdl.dask.connection import get_hub

        return get_hub().progress.call
    return lambda fn: fn()


def _run_client(main: Callable[[Any], T], address: str, options: ClusterOptions) -> T:
    import dask
    from distributed import Client

    with dask.config.set(scheduler_address=address):
        client = Client(address, timeout=options.timeout)
        try:
            client.wait_for_workers(_world().Get_size() - 2, timeout=options.timeout)
            return main(client)
        finally:
            _shutdown(client, address)


def _shutdown(client: Any, address: str) -> None:
    """Shut the cluster down through `client` (a fresh one if the script closed it): the scheduler's close lets
    every worker leave first (`hpdl.dask.shutdown`), then every rank returns."""
    try:
        if client.status == "closed":  # the script closed its client: shut down through a fresh one
            from distributed import Client

            client = Client(address, timeout=30)
        client.shutdown()
    except Exception as error:  # noqa: BLE001 - the cluster may be gone already; say so, never hang
        logger.warning("hpdl.dask: shutting the cluster down: %r", error)
    finally:
        client.close()


def initialize(
    *,
    protocol: str = "mpi",
    nthreads: int = 1,
    memory_limit: Any = "auto",
    local_directory: Optional[str] = None,
    dashboard: bool = False,
    worker_options: Optional[dict[str, Any]] = None,
    exit: bool = True,
) -> bool:
    """dask-mpi's `initialize` on mpi://: rank 1 returns True and carries on as the client; others serve.

    Rank 0 runs the scheduler and every rank >= 2 a worker until the client's
    process ends (its exit shuts the cluster down), then they `sys.exit(0)`
    (or return False with `exit=False`). On rank 1 `dask.config`'s
    `scheduler_address` is set, so `distributed.Client()` connects to it.
    """
    options = ClusterOptions(
        protocol=protocol,
        nthreads=nthreads,
        memory_limit=memory_limit,
        local_directory=local_directory,
        dashboard=dashboard,
        worker_options=worker_options,
    )
    import hpdl.dask.transport  # noqa: F401 - registers the mpi:// scheme

    world = _world()
    rank = world.Get_rank()
    _check_size(world.Get_size(), True)
    _agree_on_hosts(options)
    if rank == CLIENT:
        import dask

        address = _scheduler_address(options)
        dask.config.set(scheduler_address=address)
        atexit.register(_shutdown_at_exit, address)
        _abort_on_uncaught_exception(address)
        return True
    if rank == SCHEDULER:
        asyncio.run(_scheduler(options, None))
    else:
        asyncio.run(_worker(options, _scheduler_address(options), rank))
    if exit:
        sys.exit(0)
    return False


def _abort_on_uncaught_exception(address: str) -> None:
    """The client's script fails: print why, shut the cluster down, then MPI_Abort(1), so that mpiexec reports the
    failure (Hydra's mpiexec sometimes loses a rank's exit status and exits 0: pmodels/mpich#7057, seen here)."""
    previous = sys.excepthook

    def abort_job(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        previous(kind, value, tb)
        sys.stderr.flush()
        _shutdown_at_exit(address)
        _world().Abort(1)

    sys.excepthook = abort_job


def _shutdown_at_exit(address: str) -> None:
    """The client's process is ending: shut the cluster down through its own client (so that it does not try to
    reconnect to a scheduler that has gone while the interpreter exits), else through a fresh one."""
    from distributed import Client
    from distributed.client import default_client

    try:
        client = default_client()
    except ValueError:  # the script made no client (or closed it)
        client = None
    try:
        _shutdown(client if client is not None else Client(address, timeout=30), address)
    except Exception as error:  # noqa: BLE001 - at exit: report, never hang
        logger.warning("hpdl.dask: shutting the cluster down at exit: %r", error)
