"""Tensor (intra-layer) parallelism: Megatron-LM's column/row-parallel layers, vocabulary-parallel embedding and
cross-entropy, parallel self-attention, their convolutional analogues (filter/channel-parallel convolutions,
`conv`), and `parallelize` (in `convert`) to turn a plain model's layers into them by name pattern, in the styles
of `styles`."""

from hpdl.parallel.tensor.attention import ParallelSelfAttention
from hpdl.parallel.tensor.comm_ops import copy_to_tp, gather_from_tp, reduce_from_tp
from hpdl.parallel.tensor.conv import ChannelParallelConv, FilterParallelConv
from hpdl.parallel.tensor.convert import parallelize
from hpdl.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from hpdl.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from hpdl.parallel.tensor.shards import TPShard
from hpdl.parallel.tensor.state import full_state_dict, load_full_state_dict, tp_shards
from hpdl.parallel.tensor.styles import TP_STYLES

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "FilterParallelConv",
    "ChannelParallelConv",
    "ParallelSelfAttention",
    "vocab_parallel_cross_entropy",
    "parallelize",
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_tp",
    "TPShard",
    "tp_shards",
    "full_state_dict",
    "load_full_state_dict",
    "TP_STYLES",
]
