"""`DistributedSampler`: each rank its own shard of the data set, reshuffled every epoch.

Every rank draws the same permutation (same seed and epoch, a private
generator: the global RNG is not touched), then takes every `size`-th index
starting at its rank. For training, every rank must run the same number of
steps, or the gradient allreduce of the extra step waits for a rank that has
finished; so an uneven tail is either *padded* (default: the first indices of
the permutation are repeated until the length divides by the number of
ranks, so a few samples count twice per epoch) or *dropped*
(`drop_last=True`: the last `n % size` samples of the permutation are left
out this epoch; with shuffling, different ones each epoch). For evaluation,
`pad=False` gives an exact partition with shard sizes that differ by at most
one (fine when the ranks meet only once, to sum the metrics).

`set_epoch(e)` picks the epoch's permutation; `state_dict()` /
`load_state_dict()` carry the epoch and how many of this rank's samples
were already consumed, so that a resumed run continues mid-epoch with the
same batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Optional, Sized, Union

import torch
from torch.utils.data import Sampler

if TYPE_CHECKING:
    from hpdl.comm.base import Communicator

__all__ = ["DistributedSampler"]


class DistributedSampler(Sampler[int]):
    """Indices of this rank's shard; pass it as `sampler=` to a `torch.utils.data.DataLoader`.

    n: the data set size, or the data set itself (anything with `len`).
    comm: the communicator that gives `rank` and `size` (None: one process,
    or pass `rank` and `size` explicitly). shuffle: a new permutation every
    epoch (seeded by `seed + epoch`). drop_last: drop the uneven tail instead
    of padding it. pad: with `drop_last=False`, repeat indices so that every
    rank gets the same count (True, for training) or give an exact partition
    (False, for evaluation).
    """

    def __init__(
        self,
        n: Union[int, Sized],
        comm: Optional[Communicator] = None,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        pad: bool = True,
        rank: Optional[int] = None,
        size: Optional[int] = None,
    ) -> None:
        count = n if isinstance(n, int) else len(n)
        if count < 0:
            raise ValueError(f"DistributedSampler: n={count} must be >= 0")
        self.rank = rank if rank is not None else (comm.rank if comm is not None else 0)
        self.size = size if size is not None else (comm.size if comm is not None else 1)
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"DistributedSampler: rank {self.rank} is not in a group of size {self.size}")
        if drop_last and count < self.size:
            raise ValueError(
                f"DistributedSampler: drop_last=True with n={count} samples and {self.size} ranks leaves every "
                "rank empty; use drop_last=False (padding) or fewer ranks"
            )
        self.n = count
        self.shuffle = shuffle
        self.seed = int(seed)
        self.drop_last = drop_last
        self.pad = pad
        self.epoch = 0
        self.consumed = 0  # samples of this rank's shard already used this epoch (for resuming)

    # ------------------------------------------------------------------ sizes
    @property
    def shard_size(self) -> int:
        """Samples this rank gets per epoch (before `consumed` is skipped)."""
        if self.drop_last:
            return self.n // self.size
        if self.pad:
            return -(-self.n // self.size)  # ceil
        return self.n // self.size + (1 if self.rank < self.n % self.size else 0)

    @property
    def total_size(self) -> int:
        """Samples all ranks together get per epoch (n, less the dropped tail or plus the padding)."""
        if self.drop_last:
            return self.shard_size * self.size
        return -(-self.n // self.size) * self.size if self.pad else self.n

    def __len__(self) -> int:
        return max(0, self.shard_size - self.consumed)

    # ------------------------------------------------------------------ indices
    def permutation(self) -> list[int]:
        """The epoch's global order of indices, the same on every rank."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            return torch.randperm(self.n, generator=generator).tolist()
        return list(range(self.n))

    def shard(self) -> list[int]:
        """This rank's indices for the current epoch, including any already consumed."""
        order = self.permutation()
        if self.drop_last:
            order = order[: self.total_size]
        elif self.pad and self.total_size > self.n and self.n > 0:
            extra = self.total_size - self.n
            order = order + (order * (extra // self.n + 1))[:extra]
        return order[self.rank : self.total_size : self.size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.shard()[self.consumed :])

    # ------------------------------------------------------------------ epochs and resuming
    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of `epoch` (call it before each epoch on every rank) and start at its beginning."""
        self.epoch = int(epoch)
        self.consumed = 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "n": self.n, "size": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at `state`'s epoch and position; the data set size and seed must match."""
        if int(state["n"]) != self.n or int(state["seed"]) != self.seed:
            raise ValueError(
                f"DistributedSampler: the saved state is for n={state['n']}, seed={state['seed']} but this sampler "
                f"has n={self.n}, seed={self.seed}; build the sampler as in the saved run"
            )
        self.epoch = int(state["epoch"])
        consumed = int(state["consumed"])
        if int(state.get("size", self.size)) != self.size:
            # Another world size shards the epoch differently: restart the epoch rather than repeat samples.
            consumed = 0
        self.consumed = consumed

    def __repr__(self) -> str:
        return (
            f"DistributedSampler(n={self.n}, rank={self.rank}, size={self.size}, shuffle={self.shuffle}, "
            f"seed={self.seed}, drop_last={self.drop_last}, pad={self.pad}, epoch={self.epoch})"
        )
