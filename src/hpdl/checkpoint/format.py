"""The on-disk layout of a sharded checkpoint: one shard file per rank, then one metadata file written last.

    <path>/shard-00001-of-00004.<save id>.pt   each rank's chunks: {key: tensor}
    <path>/metadata.pt                          written last, atomically, by rank 0

The metadata says, per *logical* tensor (`model/<parameter or buffer name>`,
`optim/<parameter name>/<state key>`), its global shape and dtype, and per
chunk which file and key hold it and which part of the logical tensor it
is: `flat: (start, stop)`, a range of the row-major flattening (ZeRO
partitions), or `box: ((start, stop), ...)`, one range per dimension
(tensor- or pipeline-parallel layouts). It also lists every shard file with
its size and BLAKE2b digest, so a missing or corrupt shard is found and
named before it is used. Shards carry a save id: a new save writes new
files, the new metadata replaces the old in one rename, and only then are
the old files removed; a kill at any moment leaves one whole checkpoint.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

from hpdl.checkpoint.errors import CheckpointError, CorruptShardError, MissingShardError
from hpdl.checkpoint.files import content_digest, write_atomically

__all__ = [
    "CheckpointError",
    "MissingShardError",
    "CorruptShardError",
    "FORMAT",
    "VERSION",
    "METADATA",
    "shard_name",
    "file_digest",
    "write_shard",
    "write_metadata",
    "read_metadata",
]

FORMAT = "hpdl-sharded-checkpoint"
VERSION = 1
METADATA = "metadata.pt"


def shard_name(rank: int, size: int, save_id: str) -> str:
    return f"shard-{rank:05d}-of-{size:05d}.{save_id}.pt"


def file_digest(path: str) -> str:
    """BLAKE2b of a file's bytes, read in 1 MiB blocks (memory stays bounded)."""
    h = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_shard(folder: str, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Write one rank's chunks atomically; return its entry for the metadata (bytes and digest)."""
    path = os.path.join(folder, name)
    write_atomically(path, {"format": FORMAT + "-shard", "tensors": tensors})
    return {"bytes": os.path.getsize(path), "blake2b": file_digest(path)}


def write_metadata(folder: str, metadata: dict[str, Any]) -> None:
    payload = {"format": FORMAT, "version": VERSION, **metadata}
    payload["digest"] = content_digest(payload)
    write_atomically(os.path.join(folder, METADATA), payload)


def read_metadata(folder: str) -> dict[str, Any]:
    """The checked metadata of the checkpoint in `folder`; CheckpointError naming the problem otherwise."""
    path = os.path.join(folder, METADATA)
    if not os.path.isdir(folder):
        raise CheckpointError(f"sharded checkpoint {folder}: no such folder")
    if not os.path.exists(path):
        raise CheckpointError(
            f"sharded checkpoint {folder} has no {METADATA}: the save did not finish (the metadata is written "
            "last), or this is not an hpdl sharded checkpoint. Use an older checkpoint."
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"sharded checkpoint {folder}: {METADATA} cannot be read ({type(exc).__name__})") from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not the metadata of an hpdl sharded checkpoint")
    if payload.get("version") != VERSION:
        raise CheckpointError(f"{path} has format version {payload.get('version')}; this hpdl reads {VERSION}")
    digest = payload.pop("digest", None)
    if digest != content_digest(payload):
        raise CheckpointError(f"{path} is corrupt: its contents do not match the digest written with them")
    return payload
