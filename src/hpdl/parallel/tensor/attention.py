"""Parallel causal self-attention: the attention heads are split across the tp ranks.

A fused query/key/value ColumnParallelLinear (`parts=3`) gives each rank
whole heads; attention runs on those heads only (no communication); the
output RowParallelLinear sums the heads' contributions (one allreduce).
`parallelize` turns a plain attention module with `qkv` and `out` linears
into this by name (`{"*.attn.qkv": "qkv", "*.attn.out": "row"}`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from hpdl.comm.base import Communicator
from hpdl.models.gpt import causal_attention
from hpdl.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["ParallelSelfAttention"]


class ParallelSelfAttention(nn.Module):
    """Causal multi-head self-attention over `hidden` features with `n_head` heads, n_head / tp on each rank."""

    def __init__(
        self,
        hidden: int,
        n_head: int,
        comm: Communicator,
        *,
        bias: bool = True,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        if hidden % n_head:
            raise ValueError(f"ParallelSelfAttention: hidden={hidden} must be divisible by n_head={n_head}")
        if n_head % comm.size:
            raise ValueError(f"ParallelSelfAttention: n_head={n_head} must be divisible by the tp size {comm.size}")
        self.n_head, self.head_dim = n_head, hidden // n_head
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, comm, bias=bias, parts=3, device=device, dtype=dtype)
        self.out = RowParallelLinear(hidden, hidden, comm, bias=bias, device=device, dtype=dtype)

    @property
    def local_heads(self) -> int:
        return self.n_head // self.qkv.comm.size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(causal_attention(self.qkv(x), self.head_dim))
