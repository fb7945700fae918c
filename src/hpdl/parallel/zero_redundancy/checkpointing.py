"""ZeRO's side of `hpdl.checkpoint`'s sharded format: the chunks a rank holds, written and read by the strategy.

The format knows no strategy (`hpdl.checkpoint.ShardedState`,
`ShardedOptimizer`); `ZeroModel` and `ZeroOptimizer` implement those
protocols through these functions. Each piece of a parameter is written as
the flat range of the parameter it holds, so any layout (another stage,
rank count or a plain model) reads it back.
"""

from __future__ import annotations

from typing import Any

import torch

from hpdl.checkpoint import ShardReader, ShardWriter

__all__: list[str] = []


def write_model(writer: ShardWriter, zmodel: Any) -> None:
    """This rank's pieces of every sharded parameter (fp32 masters), as flat ranges of the full parameter."""
    for buffers in zmodel.shards:
        for piece in buffers.pieces:
            slot = buffers.unit.slots[piece.index]
            chunk = buffers.master[piece.shard_offset : piece.shard_offset + piece.numel]
            writer.add(f"model/{piece.name}", slot.shape, buffers.master.dtype, chunk, flat=(piece.start, piece.stop))


def shapes(zmodel: Any) -> dict[str, tuple[int, ...]]:
    """Full shape of every sharded parameter, from the layout (stage 3's views have no storage)."""
    return {s.name: tuple(s.shape) for b in zmodel.shards for s in b.unit.slots}


def read_model(reader: ShardReader, zmodel: Any) -> None:
    zmodel.load_master(lambda name, a, b: reader.read_flat(f"model/{name}", a, b))


def write_optimizer(writer: ShardWriter, zopt: Any) -> None:
    """This rank's pieces of the optimizer state: elementwise tensors as flat ranges, the rest once."""
    values = writer.values
    full = shapes(zopt.model)
    for name, start, stop, state in zopt.piece_states():
        for key, value in state.items():
            logical = f"optim/{name}/{key}"
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == stop - start and key != "step":
                writer.add(logical, full[name], value.dtype, value, flat=(start, stop), kind="elementwise")
            elif start == 0:  # one copy of per-parameter values: from the rank holding its first element
                if isinstance(value, torch.Tensor):
                    writer.add(logical, tuple(value.shape), value.dtype, value, kind="whole")
                else:
                    values[logical] = value


def read_optimizer(reader: ShardReader, zopt: Any, values: dict[str, Any]) -> None:
    tensors = reader.metadata["tensors"]
    for buffers in zopt.model.shards:
        for piece, param in zip(buffers.pieces, buffers.piece_params):
            prefix = f"optim/{piece.name}/"
            state: dict[str, Any] = {}
            for logical, entry in tensors.items():
                if not logical.startswith(prefix):
                    continue
                key = logical[len(prefix) :]
                if entry["kind"] == "elementwise":
                    state[key] = reader.read_flat(logical, piece.start, piece.stop).to(param.device, param.dtype)
                else:
                    state[key] = reader.read_full(logical)
            for logical, value in values.items():
                if logical.startswith(prefix):
                    state[logical[len(prefix) :]] = value
            if state:
                zopt.optimizer.state[param] = state
