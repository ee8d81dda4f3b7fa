"""Building blocks of `tfdist.models.Transformer`: config, FFN, encoder and decoder blocks.

Pre-layer-norm residual sublayers (Wang et al. 2019). Attention heads, `d_ff`
and experts are split by the layout rules through `ShardedAttention`,
`ShardedDense` (Megatron's column- then row-parallel MLP) and `MoE`; every
other feed-forward layer is an MoE when `moe_experts > 0` (GShard).
"""

import math

import keras
import numpy as np
import tensorflow as tf

from tfdist import collectives, recompute
from tfdist.layers import MoE, ShardedDense
from tfdist.layers.attention import ShardedAttention
from tfdist.config import TransformerConfig  # noqa: F401  (re-exported)


def sinusoids(length, d_model):
    """Vaswani et al.'s `[length, d_model]` sinusoidal position encodings."""
    position = np.arange(length)[:, None]
    rates = np.exp(-math.log(10000.0) * (np.arange(0, d_model, 2) / d_model))
    table = np.zeros((length, d_model), dtype="float32")
    table[:, 0::2] = np.sin(position * rates)
    table[:, 1::2] = np.cos(position * rates)[:, : d_model // 2]
    return table


@keras.saving.register_keras_serializable(package="tfdist")
class FeedForward(keras.layers.Layer):
    """Megatron's MLP: column-parallel `d_ff` (ReLU) then row-parallel back to `d_model`."""

    def __init__(self, d_ff, **kwargs):
        super().__init__(**kwargs)
        self.d_ff = d_ff
        self.inner = ShardedDense(d_ff, ("d_model", "d_ff"), activation="relu",
                                  output_sharded=True, name="inner")
        self.outer = None

    def build(self, input_shape):
        self.inner.build(input_shape)
        self.outer = ShardedDense(int(input_shape[-1]), ("d_ff", "d_model"), input_sharded=True,
                                  name="outer")
        inner_shape = tuple(input_shape[:-1]) + (self.d_ff,)
        self.outer.build(inner_shape)

    def call(self, x, training=None):
        return self.outer(self.inner(x))

    def get_config(self):
        return {**super().get_config(), "d_ff": self.d_ff}


def _feed_forward(config: TransformerConfig, index: int, name: str, causal: bool):
    """Block `index`'s FFN: MoE in every other block when `moe_experts > 0`."""
    if config.moe_experts and index % 2 == 1:
        mesh = collectives.current_mesh()
        same_axis = mesh.mesh_axis("experts") is not None and \
            mesh.mesh_axis("experts") == mesh.mesh_axis("d_ff")
        return MoE(config.moe_experts, config.d_ff, top_k=config.moe_top_k,
                   capacity_factor=config.moe_capacity_factor, group_size=config.moe_group_size,
                   aux_loss_coef=config.moe_aux_loss_coef, min_capacity=1,
                   routing=config.moe_routing, dropless=config.moe_dropless,
                   shared_d_ff=config.moe_shared_d_ff, causal=causal,
                   hidden_axis=None if same_axis else "d_ff", name=name)
    return FeedForward(config.d_ff, name=name)


class _Block(keras.layers.Layer):
    """Shared parts of encoder and decoder blocks (pre-layer-norm residual sublayers).

    With `config.remat="full"` a block keeps only its inputs for the backward
    pass and recomputes the rest there (`tfdist.remat`: the same dropout masks,
    MoE losses with their gradients, collectives run again); with "selective"
    only the attention cores are recomputed (their `[b, H, L, L]` tensors are
    most of the activations at long lengths, a small part of the FLOPs).
    """

    def __init__(self, config: TransformerConfig, index: int, cross: bool, **kwargs):
        super().__init__(**kwargs)
        self.config = config
        c = config
        self.self_norm = keras.layers.LayerNormalization(epsilon=1e-6, name="self_norm")
        core = c.remat == "selective"
        self.self_attention = ShardedAttention(c.num_heads, c.d_kv, dropout=c.dropout,
                                               remat_core=core, sequence_method=c.sequence_method,
                                               name="self_attention")
        self.cross_norm = self.cross_attention = None
        if cross:
            self.cross_norm = keras.layers.LayerNormalization(epsilon=1e-6, name="cross_norm")
            self.cross_attention = ShardedAttention(c.num_heads, c.d_kv, dropout=c.dropout,
                                                    remat_core=core,
                                                    sequence_method=c.sequence_method,
                                                    name="cross_attention")
        self.ffn_norm = keras.layers.LayerNormalization(epsilon=1e-6, name="ffn_norm")
        self.ffn = _feed_forward(c, index, "ffn", causal=cross)  # decoder blocks: causal
        self.drop = keras.layers.Dropout(c.dropout)

    def build(self, input_shape):
        for layer in (self.self_norm, self.self_attention, self.cross_norm, self.cross_attention,
                      self.ffn_norm, self.ffn):
            if layer is not None:
                layer.build(input_shape)

    def _run(self, forward, *args, **kwargs):
        full = self.config.remat == "full"
        return (recompute.remat(forward) if full else forward)(*args, **kwargs)

    def _ffn(self, x, training):
        return x + self.drop(self.ffn(self.ffn_norm(x), training=training), training=training)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)


class EncoderBlock(_Block):
    def __init__(self, config, index, **kwargs):
        super().__init__(config, index, cross=False, **kwargs)

    def call(self, x, source_mask=None, training=None):
        return self._run(self._forward, x, source_mask=source_mask, training=training)

    def _forward(self, x, source_mask=None, training=None):
        h = self.self_attention(self.self_norm(x), key_mask=source_mask, training=training)
        return self._ffn(x + self.drop(h, training=training), training)


class DecoderBlock(_Block):
    def __init__(self, config, index, **kwargs):
        super().__init__(config, index, cross=True, **kwargs)

    def call(self, x, memory, memory_mask=None, training=None):
        return self._run(self._forward, x, memory, memory_mask=memory_mask, training=training)

    def _forward(self, x, memory, memory_mask=None, training=None):
        h = self.self_attention(self.self_norm(x), causal=True, training=training)
        x = x + self.drop(h, training=training)
        h = self.cross_attention(self.cross_norm(x), memory, key_mask=memory_mask,
                                 training=training)
        return self._ffn(x + self.drop(h, training=training), training)

    def step(self, x, index, cache, memory, training=False):
        """One decoding position `x [N, 1, d]`; returns (y, cache with position `index` written).

        `cache`: this block's self-attention `keys`/`values` `[N, H, L, d_kv]`;
        `memory`: the encoder's `keys`/`values` for this block and its `bias`.
        """
        attention = self.self_attention
        h = self.self_norm(x)
        k, v = attention.project_kv(h)
        keys = attention.write_cache(cache["keys"], k, index)
        values = attention.write_cache(cache["values"], v, index)
        visible = tf.range(tf.shape(keys)[2]) <= index
        bias = tf.where(visible, 0.0, -1e9)[None, None, None, :]
        x = x + attention.attend(attention.project_query(h), keys, values, bias)
        h = self.cross_norm(x)
        x = x + self.cross_attention.attend(self.cross_attention.project_query(h),
                                            memory["keys"], memory["values"], memory["bias"])
        y = self._ffn(x, training)
        return y, {"keys": keys, "values": values}
