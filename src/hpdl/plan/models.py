"""Named reference models by their published shapes, profiled analytically (transformers) or on meta (ResNet-50).

Transformer block counts per sample (a sequence of s tokens, hidden h,
a heads, MLP width f, vocabulary V, activation element size e bytes):

- parameters: attention 2 h^2 + 2 h h_kv (+ biases), MLP 2 h f (3 h f gated), norms;
- forward FLOPs: 2 x (matrix parameters) x s + 4 s^2 h (scores and weighted sum);
- activation bytes saved for backward, Korthikanti et al., "Reducing
  Activation Recomputation in Large Transformer Models" (2022), section 4.1:
  with dropout and e = 2 this is s h (34 + 5 a s / h), of which
  s h (24 + 5 a s / h) is split by tensor parallelism (no sequence parallelism);
- tensor parallelism (Megatron-LM, Shoeybi et al. 2019): 2 allreduces of the
  block output (s h e bytes) in forward and 2 in backward.

No flash attention is assumed (the s^2 terms are stored), as on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hpdl.plan.profile import Layer, ModelProfile, ProfileError

__all__ = ["TransformerShape", "SHAPES", "transformer_profile", "resnet50_profile", "reference_profile", "NAMES"]


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer as its paper or model card gives it."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    kv_heads: Optional[int] = None
    """Grouped-query attention: key/value heads (None: as many as query heads)."""
    gated: bool = False
    """SwiGLU MLP (three matrices) instead of GELU (two)."""
    bias: bool = True
    layernorm: bool = True
    """LayerNorm with bias (GPT-2); False: RMSNorm (Llama)."""
    dropout: bool = True
    tied: bool = True
    """LM head shares the embedding matrix."""
    learned_pos: bool = True
    source: str = ""


SHAPES: dict[str, TransformerShape] = {
    # Radford et al. 2019 (GPT-2), the released checkpoints' configs.
    "gpt2": TransformerShape(12, 768, 12, 3072, 50257, 1024, source="GPT-2 small (124M)"),
    "gpt2-medium": TransformerShape(24, 1024, 16, 4096, 50257, 1024, source="GPT-2 medium (355M)"),
    "gpt2-large": TransformerShape(36, 1280, 20, 5120, 50257, 1024, source="GPT-2 large (774M)"),
    "gpt2-xl": TransformerShape(48, 1600, 25, 6400, 50257, 1024, source="GPT-2 XL (1.5B)"),
    # Touvron et al. 2023 (LLaMA), Table 2 shapes; sequence 2048.
    "llama-7b": TransformerShape(
        32,
        4096,
        32,
        11008,
        32000,
        2048,
        gated=True,
        bias=False,
        layernorm=False,
        dropout=False,
        tied=False,
        learned_pos=False,
        source="LLaMA-7B",
    ),  # fmt: skip
    "llama-13b": TransformerShape(
        40,
        5120,
        40,
        13824,
        32000,
        2048,
        gated=True,
        bias=False,
        layernorm=False,
        dropout=False,
        tied=False,
        learned_pos=False,
        source="LLaMA-13B",
    ),  # fmt: skip
    "llama-70b": TransformerShape(
        80,
        8192,
        64,
        28672,
        32000,
        4096,
        kv_heads=8,
        gated=True,
        bias=False,
        layernorm=False,
        dropout=False,
        tied=False,
        learned_pos=False,
        source="Llama-2-70B (grouped-query attention)",
    ),  # fmt: skip
}

NAMES = (*SHAPES, "resnet50")


def transformer_profile(shape: TransformerShape, name: str = "transformer", act_bytes: int = 2) -> ModelProfile:
    """Per-layer counts of a decoder-only transformer: embedding, `layers` blocks, head (formulas above)."""
    s, h, a, f, v, e = shape.seq, shape.hidden, shape.heads, shape.ffn, shape.vocab, act_bytes
    kv = (shape.kv_heads or a) * (h // a)
    bias = 1 if shape.bias else 0
    norm = (2 if shape.layernorm else 1) * h
    mats = h * h + 2 * h * kv + h * h + (3 if shape.gated else 2) * h * f
    biases = bias * (h + 2 * kv + h + (2 if shape.gated else 1) * f + h)
    block_params = mats + biases + 2 * norm
    mask = 1 if shape.dropout else 0
    # Saved for backward (section comment in the module docstring), split into what tp divides and what it does not.
    attn_split = 3 * e * s * h + e * s * h + (e + mask * (e + 1)) * a * s * s
    attn_repl = e * s * h + mask * s * h
    if shape.gated:
        mlp_split, mlp_repl = 4 * e * s * f, e * s * h
    else:
        mlp_split, mlp_repl = 2 * e * s * f, e * s * h + mask * s * h
    norms = 2 * e * s * h
    block = Layer(
        name="block",
        params=block_params,
        flops=2.0 * mats * s + 4.0 * s * s * h,
        activation_bytes=float(attn_split + attn_repl + mlp_split + mlp_repl + norms),
        output_bytes=float(e * s * h),
        tp_params=mats + bias * (2 * kv + h + (2 if shape.gated else 1) * f),
        tp_flops=2.0 * mats * s + 4.0 * s * s * h,
        tp_activation_bytes=float(attn_split + mlp_split),
        tp_allreduce_fwd=2,
        tp_allreduce_bwd=2,
        tp_max=a if not shape.kv_heads else shape.kv_heads,
    )
    embed_params = v * h + (s * h if shape.learned_pos else 0)
    embedding = Layer(
        name="embedding",
        params=embed_params,
        flops=0.0,
        activation_bytes=float(8 * s + mask * s * h),
        output_bytes=float(e * s * h),
        tp_params=v * h,
        tp_allreduce_fwd=1,
    )
    head_params = norm + (0 if shape.tied else v * h)
    head = Layer(
        name="head",
        params=head_params,
        flops=2.0 * s * h * v,
        # norm input, head input, 16-bit logits and the fp32 softmax of the loss
        activation_bytes=float(2 * e * s * h + (e + 4) * s * v),
        output_bytes=4.0 * s,
        tp_params=0 if shape.tied else v * h,
        tp_flops=2.0 * s * h * v,
        tp_activation_bytes=float((e + 4) * s * v),
        tp_allreduce_bwd=1,
        tied_params=v * h if shape.tied else 0,
        tied_to=0 if shape.tied else -1,
    )
    blocks = [Layer(**{**block.__dict__, "name": f"block.{i}"}) for i in range(shape.layers)]
    return ModelProfile(
        name=name,
        layers=(embedding, *blocks, head),
        act_dtype_bytes=e,
        sample=f"a sequence of {s} tokens",
        source=f"analytic: {shape.source or name} (h={h}, blocks={shape.layers}, heads={a}, f={f}, V={v}, s={s})",
    )


# --------------------------------------------------------------------------- ResNet-50
def _resnet50() -> object:
    """ResNet-50 (He et al. 2016) from its published stage shapes: [3, 4, 6, 3] bottlenecks, width 64..512."""
    import torch.nn as nn

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, width: int, stride: int):
            super().__init__()
            cout = width * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, width, 1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride, 1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.Conv2d(width, cout, 1, bias=False),
                nn.BatchNorm2d(cout),
            )
            self.down = (
                nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                if stride != 1 or cin != cout
                else nn.Identity()
            )
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.relu(self.body(x) + self.down(x))

    layers: list[nn.Module] = [
        nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        )
    ]
    cin = 64
    for width, count, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(count):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    layers.append(nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000)))
    return nn.Sequential(*layers)


def resnet50_profile() -> ModelProfile:
    """ResNet-50 at 224x224, measured on the meta device (exact shapes and FLOPs, nothing allocated)."""
    import torch

    from hpdl.plan.profile import measure

    with torch.device("meta"):
        model = _resnet50()
    profile = measure(model, lambda b: torch.empty(b, 3, 224, 224, device="meta"), name="resnet50", sample="224x224")
    # Convolutions are not split by Megatron-style tensor parallelism: plan them with dp and pp only.
    layers = tuple(
        Layer(**{**layer.__dict__, "tp_params": 0, "tp_flops": 0.0, "tp_activation_bytes": 0.0, "tp_max": 1})
        for layer in profile.layers
    )
    return ModelProfile(
        name="resnet50",
        layers=layers,
        act_dtype_bytes=4,
        sample="a 224x224 image",
        source="published shapes (He et al. 2016), measured on the meta device",
    )


def reference_profile(name: str, *, seq: Optional[int] = None, act_bytes: int = 2) -> ModelProfile:
    """A named reference model: one of NAMES; `seq` overrides a transformer's sequence length."""
    key = name.lower()
    if key == "resnet50":
        return resnet50_profile().at_dtype(act_bytes)
    shape = SHAPES.get(key)
    if shape is None:
        raise ProfileError(f"unknown model {name!r}; reference models: {', '.join(NAMES)} (or path.py:factory)")
    if seq is not None:
        from dataclasses import replace

        shape = replace(shape, seq=seq)
    return transformer_profile(shape, name=key, act_bytes=act_bytes)
