"""tfdist's NMT Transformer with `length` split over a mesh axis trains like one device.

Source and target sequences are both split (zig-zag, `split_sequences`): the
encoder's self-attention and the decoder's causal self-attention run over the
split sequence (ring or Ulysses), the decoder's cross-attention attends from
its tokens over the encoder's split memory, positions are global (learned
positions read their rows of the table), and the loss is the mean over the
global batch's real tokens. The reference is the same model on one device
(dense softmax attention over whole sequences, sliced positions): forward
loss, gradients, and weights and Adam slots after 10 steps must agree.
"""

import keras
import numpy as np
import pytest

from tfdist.models.transformer import SequenceCrossentropy, Transformer
from tfdist.models.transformer_layers import TransformerConfig
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import assert_equivalent, run_reference

V, BATCH, LENGTH, STEPS = 32, 4, 8, 10


def _config(method="ring"):
    # Learned positions and untied embeddings: the position table's gradient and both
    # tables' rows come from every device's tokens.
    return TransformerConfig(vocab_size=V, d_model=16, num_heads=4, d_kv=4, d_ff=32,
                             num_encoder_layers=1, num_decoder_layers=1, max_length=LENGTH,
                             dropout=0.0, positions="learned", share_embeddings=False,
                             sequence_method=method)


def _pairs(rows, seed=5):
    """Right-padded source / target pairs of LENGTH tokens (BOS + target as the
    decoder's input)."""
    rng = np.random.default_rng(seed)
    src = rng.integers(3, V, size=(rows, LENGTH)).astype("int32")
    tgt = rng.integers(3, V, size=(rows, LENGTH)).astype("int32")
    for i in range(rows):
        src[i, rng.integers(2, LENGTH + 1):] = 0
        cut = rng.integers(1, LENGTH)
        tgt[i, cut] = 2
        tgt[i, cut + 1:] = 0
    decoder_input = np.concatenate([np.ones((rows, 1), "int32"), tgt[:, :-1]], axis=1)
    decoder_input[decoder_input == 2] = 0
    return (src, decoder_input), tgt


ARGS = dict(loss=SequenceCrossentropy(V, label_smoothing=0.1),
            optimizer=lambda: keras.optimizers.Adam(1e-2), batch_size=BATCH, steps=STEPS)


@pytest.fixture(scope="module")
def data():
    return _pairs(BATCH * STEPS)


@pytest.fixture(scope="module")
def reference(data):
    x, y = data
    config = _config()
    return run_reference(lambda: Transformer(config), x, y, compare_outputs=False,
                         reference=lambda: Transformer(config), **ARGS)


@pytest.mark.parametrize("mesh, layout, method", [
    ("seq:2", "length:seq", "ring"),
    ("seq:4", "length:seq", "ring"),
    ("data:2;seq:2", "batch:data;length:seq", "ulysses"),
    # Length x model: ring attention over each device's heads, Megatron's exchanges
    # over the model axis, the vocabulary split (tables and softmax).
    ("seq:2;model:2", "length:seq;heads:model;d_ff:model;vocab:model", "ring"),
    ("seq:2;model:2", "length:seq;heads:model;d_ff:model;vocab:model", "ulysses"),
])
def test_a_sequence_split_transformer_trains_like_one_device(data, reference, mesh, layout,
                                                             method):
    x, y = data
    config = _config(method)
    report = assert_equivalent(
        lambda: Transformer(config), MeshStrategy(mesh, layout), x, y, compare_outputs=False,
        reference=lambda: Transformer(_config()), reference_run=reference, rtol=1e-5, **ARGS)
    print(f"transformer {mesh} {layout} {method}: {report}")


def test_learned_positions_get_a_dense_gradient_on_a_split_sequence():
    # Keras's Adam squares IndexedSlices values before adding duplicate rows; the
    # position rows of P devices would be P duplicates of every row of one device's
    # dense slice gradient. The sequence path reads the table with a dense gradient.
    import tensorflow as tf

    from tfdist.models.transformer import gather_rows_dense_gradient

    table = tf.Variable(tf.random.normal([8, 3]))
    positions = tf.constant([0, 1, 6, 7, 0], tf.int32)
    with tf.GradientTape() as tape:
        rows = gather_rows_dense_gradient(table, positions)
        loss = tf.reduce_sum(rows * tf.range(5.0)[:, None])
    gradient = tape.gradient(loss, table)
    assert isinstance(gradient, tf.Tensor)  # not IndexedSlices
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(table, positions) * tf.range(5.0)[:, None])
    np.testing.assert_allclose(gradient.numpy(),
                               tf.convert_to_tensor(tape.gradient(loss, table)).numpy())
