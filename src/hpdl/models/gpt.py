"""A small GPT-style character model as an `nn.Sequential`: embeddings, transformer blocks, head.

It is a plain model (no hpdl import), written so that every strategy can
take it as it is: a `Sequential` splits into pipeline stages, and its
attention reads the number of heads from the width of its query slice, so
that tensor parallelism (`tp_plan`) can split heads across ranks without
touching the code. Used by the tests, the hybrid benchmark and the
examples; the planner profiles it too.

    model = GPT(GPTConfig(vocab_size=96, block_size=64, n_layer=4, n_head=4, n_embd=128))
    logits = model(idx)                          # (batch, time, vocab)
    loss = lm_loss(logits, targets)
"""

from __future__ import annotations

import math
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "lm_loss", "stdlib_text", "CharCodec", "TP_PLAN"]

TP_PLAN = {
    "embed.tok": "vocab",
    "*.attn.qkv": "qkv",
    "*.attn.out": "row",
    "*.mlp.fc": "column",
    "*.mlp.proj": "row",
    "head.proj": "column",
}
"""Megatron's layout: heads and MLP columns split, one allreduce per attention and per MLP block in forward
and one in backward; the vocabulary split in the embedding and in the head (logits stay split: compute the loss
with `hpdl.parallel.tensor.vocab_parallel_cross_entropy`)."""


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the model; the defaults give a ~30k-parameter model for tests."""

    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    mlp_ratio: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig: {name}={value!r} must be a positive int")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout={self.dropout} must be in [0, 1)")


class Embeddings(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.block_size = config.block_size

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[-1]
        if t > self.block_size:
            raise ValueError(f"GPT: sequence length {t} exceeds block_size {self.block_size}")
        positions = torch.arange(t, device=idx.device)
        return self.drop(self.tok(idx) + self.pos(positions))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused query/key/value projection.

    The number of heads is the query width over `head_dim`, so when the
    `qkv` projection holds only some heads (tensor parallelism) the layer
    attends over those heads only.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.out = nn.Linear(config.n_embd, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out(causal_attention(self.qkv(x), self.head_dim)))


def causal_attention(qkv: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Attention of the heads in a fused (batch, time, 3 * heads * head_dim) projection; returns (b, t, heads * d)."""
    b, t, width = qkv.shape
    q, k, v = qkv.split(width // 3, dim=-1)
    heads = q.shape[-1] // head_dim
    q, k, v = (z.reshape(b, t, heads, head_dim).transpose(1, 2) for z in (q, k, v))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    mask = torch.ones(t, t, dtype=torch.bool, device=qkv.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v
    return y.transpose(1, 2).reshape(b, t, heads * head_dim)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.mlp_ratio * config.n_embd)
        self.act = nn.GELU()
        self.proj = nn.Linear(config.mlp_ratio * config.n_embd, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final layer norm and the projection to vocabulary logits (not tied to the embedding)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.ln(x))


class GPT(nn.Sequential):
    """`embed`, `block0` ... `block{n-1}`, `head`: token ids (batch, time) -> logits (batch, time, vocab)."""

    def __init__(self, config: Optional[GPTConfig] = None, **sizes: int):
        config = config if config is not None else GPTConfig(**sizes)  # type: ignore[arg-type]
        layers: OrderedDict[str, nn.Module] = OrderedDict(embed=Embeddings(config))
        for i in range(config.n_layer):
            layers[f"block{i}"] = Block(config)
        layers["head"] = Head(config)
        super().__init__(layers)
        self.config = config
        self.tp_plan = dict(TP_PLAN)
        self.apply(_init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by 1/sqrt(2 * layers)
            if name.endswith(("attn.out.weight", "mlp.proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of (batch, time, vocab) logits."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------------- data: the Python standard library's sources
class CharCodec:
    """Characters <-> ids over a fixed alphabet (printable ASCII and newline; anything else maps to '?')."""

    def __init__(self) -> None:
        self.alphabet = "\n" + "".join(chr(c) for c in range(32, 127))
        self.index = {c: i for i, c in enumerate(self.alphabet)}
        self.unknown = self.index["?"]

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index.get(c, self.unknown) for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.alphabet[int(i)] for i in ids)


def stdlib_text(max_chars: int = 200_000, modules: tuple[str, ...] = ("json", "argparse", "dataclasses")) -> str:
    """Source text of some standard-library modules (always present; nothing is downloaded)."""
    import importlib

    parts: list[str] = []
    total = 0
    for name in modules:
        module = importlib.import_module(name)
        path = getattr(module, "__file__", None)
        if path is None:
            continue
        if os.path.basename(path) == "__init__.py":
            files = sorted(os.path.join(os.path.dirname(path), f) for f in os.listdir(os.path.dirname(path)))
            files = [f for f in files if f.endswith(".py")]
        else:
            files = [path]
        for file in files:
            with open(file, encoding="utf-8", errors="replace") as handle:
                parts.append(handle.read())
            total += len(parts[-1])
            if total >= max_chars:
                return "".join(parts)[:max_chars]
    if not parts:
        raise RuntimeError(f"no standard-library sources found for {modules} under {sys.prefix}")
    return "".join(parts)[:max_chars]
