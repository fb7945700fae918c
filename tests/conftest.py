"""Shared fixtures: `ranks(backend, K)` gives a pool of K ranks that runs test bodies (see rankpool.py)."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Any, Callable, Iterator, Optional

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HPDL_TUNE_FILE", "off")  # the built-in thresholds: a developer's `hpdl tune` file is not read

from rankpool import RankError, RankPool  # noqa: E402

__all__ = ["RankError"]

BACKENDS = ("self", "mpi", "torch")
STARTED = pytest.StashKey[float]()
"""When the run began (the controller's): the files killed jobs left in /dev/shm since then are removed at its end."""

SHM_NEEDED = 512 << 20
"""Free bytes in /dev/shm the suite needs: it runs up to some 40 MPI ranks at once (two workers' rank pools and
the jobs tests start), MPICH keeps about 5 MB of /dev/shm per rank and hpdl's windows more (a whole run peaked
at about 300 MB here), and a rank that touches a page past a full /dev/shm dies of SIGBUS, MPI_Init included.
In a default container (64 MB) that failed 61 tests in 10 minutes; now the run stops at once and says why."""


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller has checked
        return
    from hpdl.comm import shm

    config.stash[STARTED] = time.time()

    free = shm.available_bytes()
    if free is not None and free < SHM_NEEDED:
        pytest.exit(
            f"the test suite needs {SHM_NEEDED >> 20} MB free in {shm.SHM_DIR} (MPI keeps shared memory there); "
            f"{shm.short_of_shared_memory(free)}",
            returncode=1,
        )


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Remove the MPI segment files the run's killed jobs left in /dev/shm (tests kill rank pools and ranks on
    purpose; each such job leaves 2-3 MB there until reboot), and say how much."""
    started = session.config.stash.get(STARTED, None)
    if started is None:  # an xdist worker: the controller sweeps once every worker is done
        return
    from hpdl.runtime import shm_leftovers

    found = shm_leftovers.leftovers(since=started)
    freed = shm_leftovers.remove(found)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if found and reporter is not None:
        size = f"{freed / 1e6:.0f} MB"
        reporter.write("\n")  # (after the progress line, which xdist leaves open)
        reporter.write_sep("-", f"removed {len(found)} MPI segment files ({size}) that killed jobs left in /dev/shm")


class SelfPool:
    """The `self` backend runs bodies in the pytest process itself."""

    backend = "self"
    nprocs = 1
    alive = True

    def __init__(self) -> None:
        from hpdl.comm.self_backend import SelfCommunicator

        self.comm = SelfCommunicator(timeout=30.0, debug=False)

    def run(self, body: Callable[..., Any], *args: Any, timeout: float = 60.0, expect_errors: bool = False) -> list:
        try:
            return [body(self.comm, *args)]
        except Exception as exc:
            if not expect_errors:
                raise
            return [RankError(0, type(exc).__name__, str(exc), "")]

    def request_exit(self) -> None:
        pass

    def close(self) -> None:
        pass


SHARED_POOLS = {
    "test_collectives.py": "shared-memory",
    "test_shared_memory.py": "shared-memory",
    "test_tune.py": "shared-memory",
    "test_torch_backend.py": "torch-backend",
    "test_torch_backend_training.py": "torch-backend",
    "test_mesh.py": "mesh",  # both run their layouts on one 4-rank MPI pool
    "test_zero_hybrid.py": "mesh",
    "test_keras_ranks.py": "mesh",  # Keras (torch backend) on the same 4 ranks
    "test_plan_validate.py": "mesh",
    "test_tensorflow.py": "tensorflow",  # one pool of 2 TensorFlow ranks (KERAS_BACKEND=tensorflow) for both
    "test_keras_tf.py": "tensorflow",
}
"""Files that start the same rank pools (the same environment) run on one pytest worker, which starts each
pool once for both; every other file is a group of its own (see pytest_xdist_make_scheduler)."""

# The longest groups (seconds under two workers, the 2026-12-01 CI machine) go first: under two xdist workers
# the last minute then holds short files on both, not one long file on one.
LONGEST_FIRST = (
    "torch-backend",  # 180
    "shared-memory",  # 155
    "test_launcher.py",  # 135
    "test_examples.py",  # 125
    "test_launchers.py",  # 45: six real launchers
    "test_multihost.py",  # 50: two simulated hosts
    "test_docs.py",  # 40
    "test_ml_bench.py",
    "test_dask_cluster.py",
    "test_plan_cli.py",
    "test_train_demo.py",
    "test_failures.py",
    "test_zero.py",
    "test_mesh_bench.py",
    "test_zero_bench.py",
    "test_pipeline_bench.py",
)


def group(item: pytest.Item) -> str:
    return SHARED_POOLS.get(item.path.name, item.path.name)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: `make test` runs two workers
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile`, with the files of one SHARED_POOLS group sent to one worker as one unit (file_groups.py)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from file_groups import FileGroups

    return FileGroups(config, log, SHARED_POOLS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: place for place, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(group(item), len(rank)))  # stable: the rest keep their order


_POOLS: OrderedDict[tuple, Any] = OrderedDict()
"""The live rank pools of this pytest process by (backend, ranks, environment), the most recently used last."""
RANKS_KEPT = 16
"""Ranks kept alive from one group of files to the next (the most recently used pools): the common pools serve
many files (each start costs seconds), and the rest end with the group that started them."""


@pytest.fixture(scope="session")
def ranks() -> Iterator[Callable[..., Any]]:
    def get(backend: str, nprocs: int = 2, env: Optional[dict[str, str]] = None) -> Any:
        if backend == "self":
            return SelfPool()
        key = (backend, nprocs, tuple(sorted((env or {}).items())))
        pool = _POOLS.get(key)
        if pool is None or not pool.alive:
            pool = _POOLS[key] = RankPool(backend, nprocs, env)
        _POOLS.move_to_end(key)
        return pool

    yield get
    _end_pools(keep=0)
    for pool in _LEAVING:
        pool.close()


_LEAVING: list[Any] = []
"""Pools asked to leave, reaped at the end of the session (their ranks finalise and exit meanwhile)."""


def pytest_runtest_teardown(item: pytest.Item, nextitem: Optional[pytest.Item]) -> None:
    """After a group's last test, end the pools past RANKS_KEPT. Kept to the end of the session (as they once
    were), every file's pools were alive at once by the end: 52 ranks, 20 GB with PyPI's torch (a CUDA build);
    a 24 GB machine ran out of memory and the suite took twice as long."""
    if _POOLS and (nextitem is None or group(nextitem) != group(item)):
        _end_pools(keep=RANKS_KEPT)


def _end_pools(keep: int) -> None:
    """Ask the least recently used pools to leave until at most `keep` ranks are alive (without waiting: they
    finalise side by side, and beside the next test)."""
    while _POOLS and sum(pool.nprocs for pool in _POOLS.values() if pool.alive) > keep:
        _, pool = _POOLS.popitem(last=False)
        pool.request_exit()
        _LEAVING.append(pool)
