"""ShardedAttention against Keras's own MultiHeadAttention (a reference sharing no code).

Padding and causal masks included, self- and cross-attention, heads split over
1, 2 and 4 devices (with data parallelism), forward, loss, gradients and
weights after 10 Adam steps.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.layers.attention import ShardedAttention
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import assert_equivalent
from tfdist.testing.reference import reference_model

B, L, M, D, H, K = 8, 6, 5, 16, 4, 4
LAYOUT = "batch:data;heads:model"


def _model():
    x = keras.Input((L, D), name="x")
    memory = keras.Input((M, D), name="memory")
    x_mask = keras.Input((L,), name="x_mask")
    memory_mask = keras.Input((M,), name="memory_mask")
    h = ShardedAttention(H, K, name="self")(x, key_mask=x_mask, causal=True)
    h = ShardedAttention(H, K, name="cross")(x + h, memory, key_mask=memory_mask)
    out = keras.layers.Dense(2, name="out")(h)
    return keras.Model([x, memory, x_mask, memory_mask], out)


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, L, D)).astype("float32")
    memory = rng.normal(size=(n, M, D)).astype("float32")
    # Padded at the end, each row at its own length (at least one real key).
    x_mask = (np.arange(L)[None] < rng.integers(1, L + 1, size=(n, 1))).astype("float32")
    memory_mask = (np.arange(M)[None] < rng.integers(1, M + 1, size=(n, 1))).astype("float32")
    y = rng.normal(size=(n, L, 2)).astype("float32")
    return (x, memory, x_mask, memory_mask), y


@pytest.mark.parametrize("mesh", ["data:1;model:4", "data:2;model:2"])
def test_sharded_attention_matches_keras_multi_head_attention(mesh):
    x, y = _data(10 * B)
    report = assert_equivalent(_model, MeshStrategy(mesh, LAYOUT), x, y,
                               loss=keras.losses.MeanSquaredError(),
                               optimizer=lambda: keras.optimizers.Adam(0.01),
                               batch_size=B, steps=10, rtol=1e-5)
    print(f"attention on {mesh}: {report}")


def test_the_masks_change_the_output():
    # So that agreeing with Keras's masked attention shows the masks were applied.
    keras.utils.set_random_seed(0)
    model = _model()
    reference = reference_model(model)
    assert type(reference.get_layer("self")).__name__ == "ReferenceAttention"
    (x, memory, x_mask, memory_mask), _ = _data(B)
    base = model.predict([x, memory, x_mask, memory_mask], verbose=0)
    np.testing.assert_allclose(base, reference.predict([x, memory, x_mask, memory_mask],
                                                       verbose=0), rtol=1e-5, atol=1e-6)
    ones = np.ones_like
    unmasked = model.predict([x, memory, ones(x_mask), ones(memory_mask)], verbose=0)
    assert np.max(np.abs(unmasked - base)) > 1e-2
    # Causal: the first position sees only itself, so changing later positions
    # leaves its output unchanged.
    later = x.copy()
    later[:, 1:] += 1.0
    changed = model.predict([later, memory, x_mask, memory_mask], verbose=0)
    np.testing.assert_allclose(changed[:, 0], base[:, 0], rtol=1e-5, atol=1e-6)
    assert np.max(np.abs(changed[:, 1:] - base[:, 1:])) > 1e-2


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("mesh", [None, "data:1;model:2"])
def test_masks_stay_finite_in_float16(mesh, mixed_float16):
    """-1e9 is -inf in float16: a fully masked row must stay finite (uniform), not NaN."""
    (x, memory, x_mask, memory_mask), y = _data(4 * B)
    memory_mask[0] = 0.0  # a row whose memory keys are all padding
    x_mask[1] = 0.0
    strategy = MeshStrategy(mesh, LAYOUT) if mesh else None
    keras.utils.set_random_seed(0)
    with (strategy.scope() if strategy else keras.name_scope("one_device")):
        model = _model()
        model.compile(keras.optimizers.Adam(0.01), "mse")
    assert model.get_layer("self").compute_dtype == "float16"
    out = model.predict((x, memory, x_mask, memory_mask), batch_size=B, verbose=0)
    assert np.isfinite(out).all()
    model.fit((x, memory, x_mask, memory_mask), y, batch_size=B, verbose=0)
    assert all(np.isfinite(w).all() for w in model.get_weights())


@pytest.mark.parametrize("causal", [True, False])
def test_attention_block_equals_the_dense_softmax(causal):
    """attention_block=4 on one device: blockwise (online softmax, causal blocks skipped)
    against the same weights' dense path; output and every gradient."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(2, 12, 16)).astype("float32"))
    mask = tf.constant((np.arange(12)[None] < np.array([[12], [7]])).astype("float32"))
    dense = ShardedAttention(4, 8, name="dense")
    blocks = ShardedAttention(4, 8, attention_block=4, name="blocks")
    dense(x), blocks(x)
    blocks.set_weights(dense.get_weights())
    results = []
    for layer in (dense, blocks):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = layer(x, key_mask=mask, causal=causal)
            loss = tf.reduce_sum(y * tf.sin(tf.range(16, dtype="float32")))
        results.append([y] + tape.gradient(loss, [x] + layer.trainable_weights))
    for got, want in zip(results[1], results[0]):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    assert blocks.get_config()["attention_block"] == 4
    with pytest.raises(ValueError, match="attention dropout .* attention_block=4"):
        ShardedAttention(4, 8, dropout=0.1, attention_block=4)(x, training=True)
    with pytest.raises(ValueError, match="attention_block=0"):
        ShardedAttention(4, 8, attention_block=0)
