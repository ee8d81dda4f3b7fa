"""A small causal LM for sequence-parallel tests and benchmarks, and its training run.

`CausalLM`: token embeddings plus sine / cosine features of each token's
*global* position (`tfdist.sequence.token_positions`), pre-norm blocks of
`ShardedAttention` (causal, padding mask) and a ReLU feed-forward, and a
vocabulary projection. On one device its attention is the dense softmax;
under a layout with `length:<axis>` it is ring or Ulysses attention over each
device's zig-zag tokens.

`train(strategy, method, ...)` fits it one step per batch on padded random
sequences (`SequenceCrossentropy`: the mean over the global batch's real
tokens) and returns the loss of every step and the weights by path;
`strategy=None` is the one-device reference.

No learned position table: its gradient is one IndexedSlices row per
position on one device but one per position *per replica* on any mesh
(data parallel alike), and Keras's Adam squares IndexedSlices values before
summing duplicate rows, so its second moment differs (the update came out
sqrt(2) larger on `data:2`; Keras's one-device Embedding gradients with
repeated tokens carry the same duplicates on both sides and agree).
"""

import dataclasses
from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from tfdist import sequence
from tfdist.layers import ShardedAttention
from tfdist.models.transformer import SequenceCrossentropy


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab: int = 32
    length: int = 16
    d_model: int = 16
    heads: int = 4
    d_kv: int = 4
    layers: int = 2
    d_ff: int = 32
    attention_block: Optional[int] = None  # ShardedAttention(attention_block=...)


def sinusoids(positions, d_model):
    """`[L, d_model]` sine / cosine features of int positions `[L]`."""
    angles = tf.cast(positions, "float32")[:, None] / 10.0 ** (
        tf.range(d_model // 2, dtype="float32") * 4.0 / d_model)[None]
    return tf.concat([tf.sin(angles), tf.cos(angles)], axis=-1)


class CausalLM(keras.Model):
    """`ids [b, L] -> logits [b, L, vocab]` (L: this device's tokens under a length split)."""

    def __init__(self, config: LMConfig = LMConfig(), method="ring", **kwargs):
        super().__init__(**kwargs)
        c = self.config = config
        self.tokens = keras.layers.Embedding(c.vocab, c.d_model, name="tokens")
        self.blocks = [(
            keras.layers.LayerNormalization(name=f"norm_a{i}"),
            ShardedAttention(c.heads, c.d_kv, sequence_method=method,
                             attention_block=c.attention_block, name=f"attention{i}"),
            keras.layers.LayerNormalization(name=f"norm_f{i}"),
            keras.layers.Dense(c.d_ff, activation="relu", name=f"ff_in{i}"),
            keras.layers.Dense(c.d_model, name=f"ff_out{i}"),
        ) for i in range(c.layers)]
        self.head = keras.layers.Dense(c.vocab, name="head")

    def call(self, ids):
        positions = sequence.token_positions(ids.shape[1])  # global positions of local tokens
        x = self.tokens(ids)
        x = x + tf.cast(sinusoids(positions, self.config.d_model), x.dtype)[None]
        mask = tf.not_equal(ids, 0)
        for norm_a, attention, norm_f, ff_in, ff_out in self.blocks:
            x = x + attention(norm_a(x), key_mask=mask, causal=True)
            x = x + ff_out(ff_in(norm_f(x)))
        return self.head(x)


def padded_sequences(config: LMConfig, rows: int, seed: int = 3):
    """`(x, y)` `[rows, length]` next-token pairs, right-padded with id 0."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, config.vocab, size=(rows, config.length + 1)).astype("int32")
    lengths = rng.integers(config.length // 3, config.length + 2, size=rows)
    ids[np.arange(config.length + 1)[None] >= lengths[:, None]] = 0
    return ids[:, :-1], ids[:, 1:]


def train(strategy, method="ring", config: LMConfig = LMConfig(), batch=4, steps=10,
          learning_rate=1e-2, optimizer=None):
    """`(losses [steps], {path: weight})` after `steps` optimizer steps (Adam, or
    `optimizer()`), one `fit` per batch."""
    x, y = padded_sequences(config, batch * steps)
    keras.utils.set_random_seed(7)
    scope = strategy.scope() if strategy else keras.utils.custom_object_scope({})
    with scope:
        model = CausalLM(config, method, name="causal_lm")
        optimizer = optimizer() if optimizer else keras.optimizers.Adam(learning_rate)
        model.compile(optimizer=optimizer, loss=SequenceCrossentropy(config.vocab))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    if strategy:
        dataset = sequence.split_sequences(dataset, strategy.mesh)
    losses = []
    for step in dataset:  # one step per fit call: every step's loss
        history = model.fit(tf.data.Dataset.from_tensors(step), epochs=1, verbose=0)
        losses.append(history.history["loss"][0])
    return np.array(losses), {w.path: np.asarray(w.numpy()) for w in model.weights}


def compare(got, want):
    """`(loss difference, worst weight difference)`, absolute maxima."""
    (losses, weights), (want_losses, want_weights) = got, want
    if weights.keys() != want_weights.keys():
        raise AssertionError(f"weights {sorted(weights)} != {sorted(want_weights)}")
    return (float(np.abs(losses - want_losses).max()),
            max(float(np.abs(v - want_weights[k]).max()) for k, v in weights.items()))
