"""`hvd.elastic` for a fixed world: `run`, `TorchState`, `ElasticSampler`.

hpdl's world does not change size while a job runs, so the part of
Horovod's elastic mode that applies is the state discipline: `state.sync()`
at the start (every rank takes rank 0's state), `state.commit()` to save a
restore point, and, when a collective fails with `HorovodInternalError`
(a mismatch the agreement caught, a failed operation), `state.restore()`
and the function runs again from the last commit. A failure that broke the
communicator (a timeout, a lost rank) is raised: resuming needs a restart
(`hpdl launch` and a checkpoint), not a new world inside the job.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from hpdl.horovod.elastic.sampler import ElasticSampler
from hpdl.horovod.elastic.state import ObjectState, State, TorchState

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler"]

MAX_RESETS = 100
"""At most this many restores in one `run` (Horovod's default reset limit is unbounded; a loop of failures
here means the script fails the same way every time)."""


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate `func(state, *args, **kwargs)`: sync the state, run, and on HorovodInternalError restore and rerun."""
    from hpdl.horovod.basics import HorovodInternalError, HostsUpdatedInterrupt
    from hpdl.horovod.process_sets import registry

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        for _ in range(MAX_RESETS + 1):
            try:
                if not skip_sync:
                    state.sync()
                return func(state, *args, **kwargs)
            except HorovodInternalError:
                world = registry.world
                if world is None or getattr(world, "_broken", False):
                    raise
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as exc:  # pragma: no cover - hpdl never raises it
                raise NotImplementedError(
                    "hpdl.horovod.elastic: the world size is fixed for the life of a job; adding or removing "
                    "hosts needs a restart from a checkpoint"
                ) from exc
            state.on_reset()
        raise RuntimeError(f"hvd.elastic.run: {MAX_RESETS} resets in a row; the failure repeats on every retry")

    return wrapper
