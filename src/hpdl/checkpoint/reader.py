"""Read any part of a logical tensor from whatever layout wrote the checkpoint.

`ShardReader.read_flat(name, start, stop)` returns elements [start, stop) of
the row-major flattening of logical tensor `name`; `read_full` the whole
tensor; `read_box` an N-d box (for tensor-parallel layouts). Chunks are
copied from the shard files that hold them: files are opened memory-mapped
(`torch.load(mmap=True, weights_only=True)`), so reading costs at most one
logical tensor of memory, and each file's digest is checked before its
first use.
"""

from __future__ import annotations

import difflib
import math
import os
from typing import Any, Optional, Sequence

import torch

from hpdl.checkpoint.errors import CheckpointError, CorruptShardError, MissingShardError
from hpdl.checkpoint.format import file_digest, read_metadata

__all__ = ["ShardReader", "read_full_tensor"]


class ShardReader:
    """Reads logical tensors of the checkpoint in `folder` (metadata read and checked at construction)."""

    def __init__(self, folder: str, metadata: Optional[dict[str, Any]] = None):
        self.folder = folder
        self.metadata = metadata if metadata is not None else read_metadata(folder)
        self._open: dict[str, dict[str, torch.Tensor]] = {}

    # ------------------------------------------------------------------ what is there
    @property
    def names(self) -> list[str]:
        return list(self.metadata["tensors"])

    def info(self, name: str) -> dict[str, Any]:
        entry = self.metadata["tensors"].get(name)
        if entry is None:
            raise CheckpointError(f"sharded checkpoint {self.folder} holds no tensor {name!r}; {self._holds(name)}")
        return entry

    def _holds(self, name: str, shown: int = 8) -> str:
        """What the checkpoint holds, for an error about `name`: every name when there are few, else the nearest."""
        names = self.names
        if not names:
            return "it holds no tensors"
        if len(names) <= shown:
            return f"it holds {', '.join(names)}"

        def score(held: str) -> float:  # a bare name ('fc.weight') is compared with the model's names unprefixed
            bare = held.removeprefix("model/")
            return max(difflib.SequenceMatcher(None, name, n).ratio() for n in (held, bare))

        nearest = sorted(names, key=score, reverse=True)[:5]
        return f"it holds {len(names)} tensors, the nearest: {', '.join(nearest)} (all: ShardReader(folder).names)"

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.info(name)["shape"])

    # ------------------------------------------------------------------ files
    def _file(self, name: str) -> dict[str, torch.Tensor]:
        loaded = self._open.get(name)
        if loaded is not None:
            return loaded
        entry = self.metadata["files"].get(name)
        path = os.path.join(self.folder, name)
        if entry is None:
            raise CheckpointError(f"sharded checkpoint {self.folder}: {name} is not listed in its metadata")
        if not os.path.exists(path):
            raise MissingShardError(
                f"sharded checkpoint {self.folder}: shard file {name} (written by rank {entry['rank']} of "
                f"{self.metadata['world_size']}) is missing. Copy every shard-*.pt file with the metadata, or use "
                "an older checkpoint."
            )
        size = os.path.getsize(path)
        if size != entry["bytes"] or file_digest(path) != entry["blake2b"]:
            raise CorruptShardError(
                f"sharded checkpoint {self.folder}: shard file {name} (written by rank {entry['rank']}) is corrupt: "
                f"{size} bytes whose digest differs from the one recorded at save time ({entry['bytes']} bytes). "
                "Use an older checkpoint."
            )
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise CorruptShardError(f"sharded checkpoint {self.folder}: shard file {name} cannot be read") from exc
        self._open[name] = payload["tensors"]
        return payload["tensors"]

    def _chunk(self, chunk: dict[str, Any]) -> torch.Tensor:
        tensors = self._file(chunk["file"])
        if chunk["key"] not in tensors:
            raise CorruptShardError(f"shard file {chunk['file']} lacks {chunk['key']} that the metadata lists")
        return tensors[chunk["key"]]

    def close(self) -> None:
        self._open.clear()

    # ------------------------------------------------------------------ reading
    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the row-major flattening of `name` (a new 1-D tensor)."""
        entry = self.info(name)
        numel = math.prod(entry["shape"])
        if not 0 <= start <= stop <= numel:
            raise ValueError(f"{name}: range [{start}, {stop}) outside its {numel} elements")
        if any("flat" not in c for c in entry["chunks"]):  # a box layout: assemble the tensor, then cut
            return self.read_full(name).reshape(-1)[start:stop].clone()
        out = torch.empty(stop - start, dtype=_dtype(entry["dtype"]))
        covered = 0
        for chunk in entry["chunks"]:
            s, e = chunk["flat"]
            lo, hi = max(start, s), min(stop, e)
            if lo < hi:
                out[lo - start : hi - start].copy_(self._chunk(chunk).reshape(-1)[lo - s : hi - s])
                covered += hi - lo
        if covered != stop - start:
            raise CheckpointError(
                f"sharded checkpoint {self.folder}: {name}[{start}:{stop}] is not fully covered by its chunks "
                f"({covered} of {stop - start} elements): the checkpoint is incomplete"
            )
        return out

    def read_full(self, name: str) -> torch.Tensor:
        """The whole logical tensor `name`, in its saved shape and dtype."""
        entry = self.info(name)
        shape = tuple(entry["shape"])
        if all("flat" in c for c in entry["chunks"]):
            return self.read_flat(name, 0, math.prod(shape)).reshape(shape)
        out = torch.empty(shape, dtype=_dtype(entry["dtype"]))
        covered = 0
        for chunk in entry["chunks"]:
            data = self._chunk(chunk)
            if "flat" in chunk:
                s, e = chunk["flat"]
                out.reshape(-1)[s:e].copy_(data.reshape(-1))
                covered += e - s
            else:
                box = tuple(slice(a, b) for a, b in chunk["box"])
                out[box].copy_(data.reshape(out[box].shape))
                covered += math.prod(b - a for a, b in chunk["box"])
        if covered < math.prod(shape):
            raise CheckpointError(f"sharded checkpoint {self.folder}: {name} is not fully covered by its chunks")
        return out

    def read_box(self, name: str, box: Sequence[Sequence[int]]) -> torch.Tensor:
        """The N-d box ((start, stop) per dimension) of `name` (reads at most the whole tensor)."""
        full = self.read_full(name)
        if len(box) != full.dim():
            raise ValueError(f"{name} has {full.dim()} dimensions; box {list(box)} gives {len(box)}")
        return full[tuple(slice(a, b) for a, b in box)].clone()


def read_full_tensor(path: str, name: str) -> torch.Tensor:
    """One logical tensor of the sharded checkpoint in `path`, whole: `model/<name>` or `optim/<name>/<key>`.

    A bare parameter or buffer name (`layer.weight`) means `model/layer.weight`.
    """
    reader = ShardReader(path)
    try:
        if name not in reader.metadata["tensors"] and f"model/{name}" in reader.metadata["tensors"]:
            name = f"model/{name}"
        return reader.read_full(name)
    finally:
        reader.close()


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in a checkpoint")
    return value
