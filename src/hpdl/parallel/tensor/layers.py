"""Column- and row-parallel linear layers and the vocabulary-parallel embedding (Megatron-LM).

ColumnParallelLinear splits the output features: each tp rank computes its
slice of the output from the full input. RowParallelLinear splits the input
features: each rank multiplies its slice of the input and the partial
outputs are summed (one allreduce). Put a column layer before a row layer
(attention: qkv then out; MLP: fc then proj) and the pair costs one
allreduce forward and one backward, with no communication in between.

Every layer keeps its local parameters under the plain layer's names
(`weight`, `bias`), plus `tp_shards` saying where each split parameter sits
in the full tensor (`TPShard`), so state dicts, checkpoints and optimizers
see the same logical names as for the plain model.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hpdl.comm.base import Communicator
from hpdl.parallel.tensor.comm_ops import copy_to_tp, gather_from_tp, reduce_from_tp
from hpdl.parallel.tensor.shards import TPShard

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]


def _check_split(name: str, what: str, extent: int, ways: int) -> None:
    if extent % ways:
        raise ValueError(f"{name}: {what} ({extent}) must be divisible by tp size x blocks ({ways})")


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (output features) split across the tp ranks.

    `parts` > 1 splits each of `parts` equal output blocks separately (3
    for a fused query/key/value projection, so each rank keeps whole
    heads). With `gather_output` the full output is gathered on every rank;
    otherwise the output stays split (feed it to a RowParallelLinear, or to
    `vocab_parallel_cross_entropy` for logits).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Communicator,
        *,
        bias: bool = True,
        gather_output: bool = False,
        parts: int = 1,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        _check_split(type(self).__name__, "out_features", out_features, parts * comm.size)
        if gather_output and parts != 1:
            raise ValueError("ColumnParallelLinear: gather_output needs parts=1 (a fused qkv output stays split)")
        self.in_features, self.out_features, self.comm = in_features, out_features, comm
        self.gather_output, self.parts = bool(gather_output), parts
        local = out_features // comm.size
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local, device=device, dtype=dtype)) if bias else None
        self.tp_shards = {"weight": TPShard((out_features, in_features), 0, comm.rank, comm.size, parts)}
        if bias:
            self.tp_shards["bias"] = TPShard((out_features,), 0, comm.rank, comm.size, parts)
        _reset_linear(self.weight, self.bias, in_features)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, comm: Communicator, *, parts: int = 1, gather_output: bool = False
    ) -> ColumnParallelLinear:
        """This rank's slice of an existing `nn.Linear` (same values, same device and dtype)."""
        w = linear.weight
        layer = cls(
            linear.in_features,
            linear.out_features,
            comm,
            bias=linear.bias is not None,
            gather_output=gather_output,
            parts=parts,
            device=w.device,
            dtype=w.dtype,
        )
        layer.load_full(linear.weight, linear.bias)
        return layer

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        """Copy this rank's slice of full-size parameters into the layer."""
        self.weight.copy_(self.tp_shards["weight"].take(weight.detach()))
        if self.bias is not None and bias is not None:
            self.bias.copy_(self.tp_shards["bias"].take(bias.detach()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp(x, self.comm), self.weight, self.bias)
        return gather_from_tp(y, self.comm) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} ({self.weight.shape[0]} here), "
            f"tp={self.comm.size}, parts={self.parts}, bias={self.bias is not None}, gather_output={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """y = sum over tp ranks of x_r W_r^T, plus b: W's columns (input features) split across the tp ranks.

    The input is this rank's slice of the features (`input_is_parallel`,
    the output of a ColumnParallelLinear); with `input_is_parallel=False`
    the layer takes the full input and slices it. The bias is replicated
    and added once, after the sum.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        comm: Communicator,
        *,
        bias: bool = True,
        input_is_parallel: bool = True,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        _check_split(type(self).__name__, "in_features", in_features, comm.size)
        self.in_features, self.out_features, self.comm = in_features, out_features, comm
        self.input_is_parallel = bool(input_is_parallel)
        local = in_features // comm.size
        self.weight = nn.Parameter(torch.empty(out_features, local, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        self.tp_shards = {"weight": TPShard((out_features, in_features), 1, comm.rank, comm.size)}
        _reset_linear(self.weight, self.bias, in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm: Communicator, *, input_is_parallel: bool = True) -> RowParallelLinear:
        w = linear.weight
        layer = cls(
            linear.in_features,
            linear.out_features,
            comm,
            bias=linear.bias is not None,
            input_is_parallel=input_is_parallel,
            device=w.device,
            dtype=w.dtype,
        )
        layer.load_full(linear.weight, linear.bias)
        return layer

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        self.weight.copy_(self.tp_shards["weight"].take(weight.detach()))
        if self.bias is not None and bias is not None:
            self.bias.copy_(bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            width = self.weight.shape[1]
            x = copy_to_tp(x, self.comm)[..., self.comm.rank * width : (self.comm.rank + 1) * width]
        y = reduce_from_tp(F.linear(x, self.weight), self.comm)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} ({self.weight.shape[1]} here), out_features={self.out_features}, "
            f"tp={self.comm.size}, bias={self.bias is not None}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding table whose rows (the vocabulary) are split across the tp ranks.

    Each rank looks up the ids in its range (others give zeros) and the
    lookups are summed across ranks (one allreduce in forward).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        comm: Communicator,
        *,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        _check_split(type(self).__name__, "num_embeddings", num_embeddings, comm.size)
        self.num_embeddings, self.embedding_dim, self.comm = num_embeddings, embedding_dim, comm
        local = num_embeddings // comm.size
        self.start, self.end = comm.rank * local, (comm.rank + 1) * local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, device=device, dtype=dtype))
        self.tp_shards = {"weight": TPShard((num_embeddings, embedding_dim), 0, comm.rank, comm.size)}
        nn.init.normal_(self.weight)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, comm: Communicator) -> VocabParallelEmbedding:
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError("VocabParallelEmbedding: padding_idx and max_norm are not supported; remove them first")
        w = embedding.weight
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, comm, device=w.device, dtype=w.dtype)
        layer.load_full(w)
        return layer

    @torch.no_grad()
    def load_full(self, weight: torch.Tensor) -> None:
        self.weight.copy_(self.tp_shards["weight"].take(weight.detach()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.comm.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight) * (~outside).unsqueeze(-1).to(self.weight.dtype)
        return reduce_from_tp(rows, self.comm)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} ({self.start}:{self.end} here), {self.embedding_dim}, tp={self.comm.size}"


def _reset_linear(weight: nn.Parameter, bias: Optional[nn.Parameter], fan_in: int) -> None:
    """nn.Linear's default initialisation, applied to this rank's slice (fan-in of the full layer)."""
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0  # kaiming_uniform(a=sqrt(5)) of the full layer
    nn.init.uniform_(weight, -bound, bound)
    if bias is not None:
        nn.init.uniform_(bias, -bound, bound)
