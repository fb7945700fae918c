"""Wire format of the mpi:// transport: headers, inline packing and chunking of frames.

Every message on the transport's tag is one of a few kinds, told apart by an
int64 header (see `Kind`). A Dask message (distributed's `to_frames` list)
travels either *inline* (header and all frames copied into one MPI message:
one message per Dask message, the lowest latency for small messages) or as a
header followed by each frame in chunks of at most `chunk_bytes` (MPI counts
are C ints in MPI-3: 2**31-1 elements). Large frames are sent from and
received into their own buffers (NumPy memory, zero copies); only inline
messages are copied.
"""

from __future__ import annotations

import enum
from typing import Any, Iterator, Sequence

import numpy as np

import hpdl.settings as settings

__all__ = [
    "INT_MAX",
    "Kind",
    "chunk_bytes",
    "chunks",
    "copied",
    "inline_limit",
    "pack_header",
    "pack_inline",
    "receive_buffers",
    "send_views",
    "unpack",
]

INT_MAX = 2**31 - 1
"""The largest count of one MPI-3 call."""
HEADER_WORDS = 3
"""kind, connection id, sender-is-initiator: the fixed part of every header."""


class Kind(enum.IntEnum):
    """What a message on the transport's tag means."""

    CONNECT = 1  # [kind, cid, 1, listener id]
    ACCEPT = 2  # [kind, cid, 0]
    REFUSE = 3  # [kind, cid, 0]
    DATA = 4  # [kind, cid, side, nframes, size...]; the frames follow as separate messages
    INLINE = 5  # [kind, cid, side, nframes, size...] + the frames' bytes in the same message
    CLOSE = 6  # [kind, cid, side]


def chunk_bytes() -> int:
    """Bytes per MPI message of a large frame (HPDL_DASK_MPI_CHUNK, default and maximum 2**31-1)."""
    return settings.number("HPDL_DASK_MPI_CHUNK")  # the registry's bounds: 1 to INT_MAX


def inline_limit() -> int:
    """Messages with at most this many frame bytes travel as one MPI message (HPDL_DASK_MPI_INLINE, 4 MiB)."""
    return settings.number("HPDL_DASK_MPI_INLINE")


def chunks(nbytes: int, limit: int) -> Iterator[tuple[int, int]]:
    """(start, stop) of each MPI message of a frame of `nbytes`; none for an empty frame."""
    for start in range(0, nbytes, limit):
        yield start, min(nbytes, start + limit)


def send_views(frames: Sequence[Any]) -> list[memoryview]:
    """Each frame as a flat byte view of its own memory (a copy only for non-contiguous buffers)."""
    from distributed.utils import ensure_memoryview

    return [ensure_memoryview(frame) for frame in frames]


def pack_header(kind: Kind, cid: int, side: int, *payload: int) -> np.ndarray:
    return np.array([int(kind), cid, side, *payload], dtype=np.int64)


def pack_inline(cid: int, side: int, views: Sequence[memoryview]) -> np.ndarray:
    """One buffer: the INLINE header and every frame's bytes after it."""
    header = pack_header(Kind.INLINE, cid, side, len(views), *(v.nbytes for v in views))
    out = np.empty(header.nbytes + sum(v.nbytes for v in views), dtype=np.uint8)
    out[: header.nbytes] = header.view(np.uint8)
    offset = header.nbytes
    for view in views:
        out[offset : offset + view.nbytes] = np.frombuffer(view, dtype=np.uint8)
        offset += view.nbytes
    return out


def unpack(message: np.ndarray) -> tuple[Kind, int, int, list[int], list[memoryview]]:
    """(kind, cid, side, payload ints, inline frames) of a received control/header message (uint8 array)."""
    if message.nbytes < HEADER_WORDS * 8:
        raise ValueError(f"mpi:// protocol error: a message of {message.nbytes} bytes is shorter than a header")
    words = message[: (message.nbytes // 8) * 8].view(np.int64)
    kind = Kind(int(words[0]))
    cid, side = int(words[1]), int(words[2])
    if kind not in (Kind.DATA, Kind.INLINE):
        return kind, cid, side, [int(w) for w in words[HEADER_WORDS:]], []
    count = int(words[HEADER_WORDS])
    sizes = [int(s) for s in words[HEADER_WORDS + 1 : HEADER_WORDS + 1 + count]]
    if kind == Kind.DATA:
        return kind, cid, side, sizes, []
    offset = (HEADER_WORDS + 1 + count) * 8
    data = message.data[offset:]
    frames = []
    for size in sizes:  # views of the one received buffer: distributed keeps them alive as needed
        frames.append(data[:size])
        data = data[size:]
    return kind, cid, side, sizes, frames


def copied(views: Sequence[memoryview]) -> list[memoryview]:
    """A copy of each frame in fresh host memory: what the reader of a socket gets (bytes of its own, which the
    writer may reuse or change once the write is done)."""
    copies = receive_buffers([view.nbytes for view in views])
    for copy, view in zip(copies, views):
        if view.nbytes:
            np.frombuffer(copy, dtype=np.uint8)[:] = np.frombuffer(view, dtype=np.uint8)
    return copies


def receive_buffers(sizes: Sequence[int]) -> list[memoryview]:
    """Uninitialised host memory for each incoming frame (no zero-filling pass)."""
    from distributed.protocol.utils import host_array

    return [host_array(size) if size else memoryview(b"") for size in sizes]
