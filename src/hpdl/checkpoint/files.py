"""The file mechanics every hpdl checkpoint shares: atomic, durable writes and a digest of the contents.

`write_atomically` writes into a temporary file in the same folder,
flushes and fsyncs it, renames it over the target with `os.replace` and
fsyncs the folder: a kill at any moment leaves the old file or the new
one. `content_digest` is a BLAKE2b over a payload's structure, plain values and
tensor bytes (torch's zip container does not check the bytes it reads).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch

__all__ = ["write_atomically", "content_digest", "unwrap"]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module inside a wrapper (DataParallel and similar keep it as `.module`)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def write_atomically(path: str, payload: dict[str, Any]) -> None:
    """Write `payload` (torch.save) to `path` so that a kill leaves the old file or the new one, never half."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    try:  # make the rename itself durable
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def content_digest(obj: Any) -> str:
    """BLAKE2b over the structure, plain values and tensor bytes of `obj` (dict order as stored)."""
    h = hashlib.blake2b(digest_size=20)

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous().reshape(-1)
            h.update(f"T{t.dtype}{tuple(x.shape)};".encode())
            h.update(t.view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            h.update(f"D{len(x)};".encode())
            for key, value in x.items():
                h.update(f"K{key!r};".encode())
                walk(value)
        elif isinstance(x, (list, tuple)):
            h.update(f"L{len(x)};".encode())
            for value in x:
                walk(value)
        else:
            h.update(f"V{x!r};".encode())

    walk(obj)
    return h.hexdigest()
