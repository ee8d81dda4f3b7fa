"""Models built from tfdist layers."""

from tfdist.models.token_mlp import build_token_mlp, make_copy_task
from tfdist.models.transformer import (
    InverseSqrtSchedule,
    SequenceCrossentropy,
    Transformer,
)
from tfdist.models.transformer_layers import TransformerConfig

__all__ = [
    "InverseSqrtSchedule",
    "SequenceCrossentropy",
    "Transformer",
    "TransformerConfig",
    "build_token_mlp",
    "make_copy_task",
]
