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
    "filter": "FilterParallelConv: a convolution's filters (output channels) split; the output stays split "
    "(pair it with a 'channel' layer): the convolutional 'column'",
    "channel": "ChannelParallelConv: a convolution's input channels split; the partial outputs are summed: "
    "the convolutional 'row'",
    "filter_gather": "FilterParallelConv whose output channels are gathered back (e.g. before a batch norm)",
}
"""Tensor-parallel styles that `Plan.tp_plan` may name, with what each does."""

_CONV_STYLES = ("filter", "channel", "filter_gather")


def split_problem(module: Any, style: str, tp: int) -> str:
    """Why `module` cannot be split `tp` ways in `style` ('' when it can)."""
    if style == "vocab":
        if not isinstance(module, nn.Embedding):
            return f"'vocab' splits an nn.Embedding; this is a {type(module).__name__}"
        if module.num_embeddings % tp:
            return f"the vocabulary ({module.num_embeddings}) does not divide by {tp}"
        return ""
    if style in _CONV_STYLES:
        if not isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            return f"'{style}' splits an nn.Conv1d/2d/3d; this is a {type(module).__name__}"
        if module.groups != 1:
            return f"groups={module.groups}: grouped convolutions are not split"
        if module.padding_mode != "zeros":
            return f"padding_mode={module.padding_mode!r}: only zeros padding is split"
        what, extent = (
            ("in_channels", module.in_channels) if style == "channel" else ("out_channels", module.out_channels)
        )
        return f"{what} ({extent}) does not divide by {tp}" if extent % tp else ""
    if not isinstance(module, nn.Linear):
        hint = " (for a convolution: 'filter' / 'channel')" if isinstance(module, nn.modules.conv._ConvNd) else ""
        return f"'{style}' splits an nn.Linear; this is a {type(module).__name__}{hint}"
    if style == "row":
        return f"in_features ({module.in_features}) does not divide by {tp}" if module.in_features % tp else ""
    if style == "qkv":
        if module.out_features % 3:
            return f"out_features ({module.out_features}) is not 3 x hidden (query, key, value)"
        per = module.out_features // 3
        return f"hidden ({per}) does not divide by {tp}" if per % tp else ""
    return f"out_features ({module.out_features}) does not divide by {tp}" if module.out_features % tp else ""
