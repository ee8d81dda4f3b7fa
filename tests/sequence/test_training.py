"""A causal LM with `length` split over a mesh axis trains like one device under `fit`.

The model (token embeddings plus sinusoids of each token's global position, pre-norm blocks of
`ShardedAttention` and a feed-forward, a vocabulary projection) is the same
Keras model on both sides; on one device its attention is the dense softmax
path, under `length:seq` ring or Ulysses attention over each device's
zig-zag tokens (`split_sequences`). Loss history and every weight after 10
Adam steps must agree to 1e-5.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist import sequence
from tfdist.layers import ShardedAttention
from tfdist.models.transformer import SequenceCrossentropy
from tfdist.strategies import MeshStrategy

VOCAB, LENGTH, D, HEADS, D_KV, BATCH, STEPS = 32, 16, 16, 4, 4, 4, 10


def _sinusoids(positions):
    """`[L, D]` sine / cosine position features (no weights: see the note below)."""
    angles = tf.cast(positions, "float32")[:, None] / 10.0 ** (tf.range(D // 2, dtype="float32")
                                                              * 4.0 / D)[None]
    return tf.concat([tf.sin(angles), tf.cos(angles)], axis=-1)


# Not a learned position table: its gradient is one IndexedSlices row per position on one
# device but one per position *per replica* on any mesh (data:2 alike), and Keras's Adam
# squares IndexedSlices values before summing duplicates, so the second moment differs
# (found here; the update came out sqrt(2) larger on data:2 without any sequence split).


class TinyLM(keras.Model):
    def __init__(self, method="ring", **kwargs):
        super().__init__(**kwargs)
        self.method = method
        self.tokens = keras.layers.Embedding(VOCAB, D, name="tokens")
        self.blocks = []
        for i in range(2):
            self.blocks.append((
                keras.layers.LayerNormalization(name=f"norm_a{i}"),
                ShardedAttention(HEADS, D_KV, sequence_method=method, name=f"attention{i}"),
                keras.layers.LayerNormalization(name=f"norm_f{i}"),
                keras.layers.Dense(2 * D, activation="relu", name=f"ff_in{i}"),
                keras.layers.Dense(D, name=f"ff_out{i}"),
            ))
        self.head = keras.layers.Dense(VOCAB, name="head")

    def call(self, ids):
        positions = sequence.token_positions(ids.shape[1])  # global positions of local tokens
        x = self.tokens(ids) + _sinusoids(positions)[None]
        mask = tf.not_equal(ids, 0)
        for norm_a, attention, norm_f, ff_in, ff_out in self.blocks:
            x = x + attention(norm_a(x), key_mask=mask, causal=True)
            x = x + ff_out(ff_in(norm_f(x)))
        return self.head(x)


def _data():
    rng = np.random.default_rng(3)
    ids = rng.integers(1, VOCAB, size=(BATCH * STEPS, LENGTH + 1)).astype("int32")
    lengths = rng.integers(LENGTH // 3, LENGTH + 2, size=BATCH * STEPS)
    ids[np.arange(LENGTH + 1)[None] >= lengths[:, None]] = 0  # right padding
    return ids[:, :-1], ids[:, 1:]


def _train(strategy, method):
    x, y = _data()
    keras.utils.set_random_seed(7)
    scope = strategy.scope() if strategy else keras.utils.custom_object_scope({})
    with scope:
        model = TinyLM(method, name="tiny_lm")
        model.compile(optimizer=keras.optimizers.Adam(1e-2),
                      loss=SequenceCrossentropy(VOCAB))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    if strategy:
        dataset = sequence.split_sequences(dataset, strategy.mesh)
    losses = []
    for batch in dataset:  # one step per fit call: the loss of every step
        history = model.fit(tf.data.Dataset.from_tensors(batch), epochs=1, verbose=0)
        losses.append(history.history["loss"][0])
    return np.array(losses), {w.path: np.asarray(w.numpy()) for w in model.weights}


@pytest.fixture(scope="module")
def one_device():
    return _train(None, "ring")


@pytest.mark.parametrize("mesh, method", [
    ("seq:2", "ring"),
    ("seq:4", "ring"),
    ("data:2;seq:2", "ring"),
    ("seq:2", "ulysses"),
    ("data:2;seq:2", "ulysses"),
])
def test_fit_equals_one_device(one_device, mesh, method):
    strategy = MeshStrategy(mesh, layout="batch:data;length:seq" if "data" in mesh
                            else "length:seq")
    losses, weights = _train(strategy, method)
    want_losses, want_weights = one_device
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    assert weights.keys() == want_weights.keys()
    for path, value in weights.items():
        np.testing.assert_allclose(value, want_weights[path], rtol=1e-5, atol=1e-5, err_msg=path)


def test_split_and_merge_sequences_round_trip():
    strategy = MeshStrategy("data:2;seq:2", layout="batch:data;length:seq")
    x = np.arange(4 * 8).reshape(4, 8)
    rows = np.arange(4)
    (local, local_rows), = sequence.split_sequences(
        tf.data.Dataset.from_tensors((x, rows)), strategy.mesh)
    # device 1 (data 0, seq 1): rows 0-1, zig-zag tokens 2 3 4 5
    np.testing.assert_array_equal(local.numpy()[2:4], x[0:2, 2:6])
    np.testing.assert_array_equal(local_rows.numpy(), [0, 1, 0, 1, 2, 3, 2, 3])
    np.testing.assert_array_equal(sequence.merge_sequences(local.numpy(), strategy.mesh), x)
