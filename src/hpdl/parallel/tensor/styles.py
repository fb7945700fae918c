"""The tensor-parallel styles a layer plan may name (`TP_STYLES`), and whether a layer can be split in one.

They belong to the tensor-parallel strategy; `hpdl.parallel.Plan` (in
`hpdl.parallel.mesh.plan_config`, above every strategy) validates its
`tp_plan` against them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["TP_STYLES", "split_problem"]

TP_STYLES = {
    "column": "ColumnParallelLinear: output features split; the output stays split (pair it with a 'row' layer)",
    "row": "RowParallelLinear: input features split; the partial outputs are summed across tp ranks",
    "qkv": "fused query/key/value Linear split by attention heads (3 column blocks); attention runs on local heads",
    "vocab": "VocabParallelEmbedding: vocabulary rows split; the lookups are summed across tp ranks",
    "column_gather": "ColumnParallelLinear whose output is gathered back to full width (e.g. an output layer)",
}
"""Tensor-parallel styles that `Plan.tp_plan` may name, with what each does."""


def split_problem(module: Any, style: str, tp: int) -> str:
    """Why `module` cannot be split `tp` ways in `style` ('' when it can)."""
    if style == "vocab":
        if not isinstance(module, nn.Embedding):
            return f"'vocab' splits an nn.Embedding; this is a {type(module).__name__}"
        if module.num_embeddings % tp:
            return f"the vocabulary ({module.num_embeddings}) does not divide by {tp}"
        return ""
    if not isinstance(module, nn.Linear):
        return f"'{style}' splits an nn.Linear; this is a {type(module).__name__}"
    if style == "row":
        return f"in_features ({module.in_features}) does not divide by {tp}" if module.in_features % tp else ""
    if style == "qkv":
        if module.out_features % 3:
            return f"out_features ({module.out_features}) is not 3 x hidden (query, key, value)"
        per = module.out_features // 3
        return f"hidden ({per}) does not divide by {tp}" if per % tp else ""
    return f"out_features ({module.out_features}) does not divide by {tp}" if module.out_features % tp else ""
