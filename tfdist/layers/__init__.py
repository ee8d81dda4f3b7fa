"""Keras layers whose weights declare logical axes and compute on their shard."""

from tfdist.layers.attention import ShardedAttention
from tfdist.layers.dense import ShardedDense
from tfdist.layers.embedding import ShardedEmbedding
from tfdist.layers.moe import MoE
from tfdist.layers.sharded_softmax import (
    ShardedSoftmax,
    ShardedSparseCategoricalCrossentropy,
    ShardedTopK,
    ShardedTopKAccuracy,
)
from tfdist.layers.weights import add_sharded_weight

__all__ = [
    "MoE",
    "ShardedAttention",
    "ShardedDense",
    "ShardedEmbedding",
    "ShardedSoftmax",
    "ShardedSparseCategoricalCrossentropy",
    "ShardedTopK",
    "ShardedTopKAccuracy",
    "add_sharded_weight",
]
