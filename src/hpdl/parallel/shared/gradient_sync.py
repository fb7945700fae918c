"""`no_sync` and `sync_gradients`, written once for every wrapper that reduces gradients from backward hooks.

DataParallel, SpatialParallel and ZeRO's ZeroModel each hold a `reducer`
(`enabled`, `sync_now()`); a pipeline accumulates its micro-batches under
`no_sync` and reduces once per step, whichever wrapper its stage has.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

__all__ = ["LocalAccumulation"]


class LocalAccumulation:
    """Mixin for a module with a `reducer`: backward passes inside `no_sync` accumulate locally."""

    reducer: Any

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next backward outside reduces the sum.

        As with DDP, scale the loss (for example by 1/k for k micro-batches)
        if the step should use the mean over micro-batches.
        """
        previous = self.reducer.enabled
        self.reducer.enabled = False
        try:
            yield
        finally:
            self.reducer.enabled = previous

    def sync_gradients(self) -> None:
        """Reduce the current gradients now (collective): after `no_sync` passes with no synced backward to follow."""
        self.reducer.sync_now()
