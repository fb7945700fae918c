"""ElasticSampler: a distributed sampler that remembers how far the epoch got, to resume mid-epoch."""

from __future__ import annotations

import math
import random
from typing import Any, Iterator

import torch

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler):
    """Each rank's share of `dataset`'s indices (shuffled by `seed + epoch`), without the samples already
    processed this epoch (`record_batch`); `state_dict` / `load_state_dict` carry the position."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` (call it at the end of an epoch, so a partial one is not repeated)."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count a batch of `batch_size` per rank as processed (by every rank)."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Any) -> None:
        self.processed_num += len(indices) * self.num_replicas

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        from hpdl.horovod import basics

        self.num_replicas = basics.size()
        self.rank = basics.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num :]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = list(self.remaining_indices)
        if indices:
            while len(indices) < self.total_size:  # pad by wrapping so every rank gets num_samples
                indices += indices[: self.total_size - len(indices)]
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
