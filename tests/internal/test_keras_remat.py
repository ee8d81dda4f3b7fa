"""Recomputation: Keras 3.15's TF remat (`tf.recompute_grad`) trains differently; tfdist's does not.

Each test runs the same layer three ways from the same state: keeping its
activations (the truth), recomputed by Keras's own TF remat (the bug, shown),
and recomputed by `tfdist.internal.keras_remat` (the fix).
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow import core as tf_core

import tfdist
from tfdist.internal import keras_remat
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import max_rel_diff


class Block(keras.layers.Layer):
    """Dense -> dropout (training passed on) -> a context-dependent layer -> Dense, plus a loss."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.inner = keras.layers.Dense(16, activation="relu")
        self.drop = keras.layers.Dropout(0.5, seed=1)
        self.scale = TrainingScale()
        self.norm = keras.layers.BatchNormalization()
        self.outer = keras.layers.Dense(4)

    def call(self, x, training=None):
        h = self.drop(self.inner(x), training=training)
        h = self.scale(h)  # `training` from Keras's call context
        self.add_loss(0.1 * tf.reduce_sum(tf.square(h)))  # needs its gradient
        return self.outer(self.norm(h, training=training))


class TrainingScale(keras.layers.Layer):
    def call(self, x, training=None):
        return x * 3.0 if training else x


def _state(block):
    """Weights, BatchNorm statistics and seed-generator states (`weights` has no seeds)."""
    return [v.numpy().copy() for v in block.variables]


def _set_state(block, state):
    for v, value in zip(block.variables, state):
        v.assign(value)


def _grads(block, call, x):
    with tf.GradientTape() as tape:
        y = call(x, training=True)
        loss = tf.reduce_sum(y * tf.range(4, dtype=y.dtype)) + tf.add_n(block.losses)
    return [g.numpy() for g in tape.gradient(loss, block.trainable_weights)]


def _worst(a, b):
    return max(max_rel_diff(u, v) for u, v in zip(a, b))


def _three_ways(run):
    """(kept, Keras's remat, tfdist's remat): `run(block, wrap)` from one starting state."""
    keras.utils.set_random_seed(0)
    block = Block()
    x = tf.constant(np.random.default_rng(0).normal(size=(8, 6)), "float32")
    block(x)
    start = _state(block)
    results = []
    for wrap in (lambda f: f, keras_remat._KERAS_REMAT, keras_remat.remat):
        _set_state(block, start)
        block._clear_losses()  # `call` is run directly: Keras's `__call__` would clear them
        results.append(run(block, wrap, x))
    return results


def test_the_keras_hooks_still_exist():
    assert keras_remat._KERAS_REMAT.__module__ == tf_core.__name__
    assert keras_remat._KERAS_ADD_LOSS.__qualname__ == "Layer.add_loss"
    assert keras_remat._KERAS_ADD_LOSS.__module__ == "keras.src.layers.layer"
    MeshStrategy("data:2")  # every tfdist mesh strategy installs the hook
    assert keras_remat.installed()
    # Keras's front ends reach it: keras.remat and a layer built under RematScope.
    assert keras.remat(lambda x: x).__code__ is keras_remat.remat(lambda x: x).__code__
    with keras.RematScope(mode="full"):
        layer = keras.layers.Dense(3)
    calls = []
    original = keras_remat.remat

    def spy(f):
        calls.append(f)
        return original(f)

    tf_core.remat = spy
    try:
        layer(tf.ones((2, 2)))
    finally:
        keras_remat.install()
    assert calls, "a layer built under RematScope no longer calls the backend's remat"


def test_eager_gradients_dropout_losses_statistics_and_context_equal_kept_activations():
    def run(block, wrap, x):
        grads = _grads(block, wrap(block.call), x)
        return grads, _state(block)

    (kept, kept_state), (keras_grads, keras_state), (grads, state) = _three_ways(run)
    # The bug: other dropout masks and `training=None` in the recomputation, the
    # added loss without gradient, seeds and BatchNorm statistics updated twice.
    assert _worst(keras_grads, kept) > 1e-2
    assert _worst(keras_state, kept_state) > 1e-3
    # The fix: the same gradients, every variable updated once.
    assert _worst(grads, kept) < 1e-6
    assert _worst(state, kept_state) == 0.0


def test_the_added_loss_keeps_its_gradient():
    """Keras's remat alone (no dropout, no context): the `add_loss` gradient is dropped."""

    class Penalised(keras.layers.Layer):
        def build(self, shape):
            self.kernel = self.add_weight(shape=(shape[-1], 3), initializer="ones")

        def call(self, x):
            self.add_loss(tf.reduce_sum(self.kernel ** 2))
            return x @ self.kernel

    results = []
    for wrap in (lambda f: f, keras_remat._KERAS_REMAT, keras_remat.remat):
        layer = Penalised()
        layer(tf.ones((2, 4)))
        with tf.GradientTape() as tape:
            y = wrap(layer.call)(tf.ones((2, 4)))
            loss = tf.reduce_sum(y) + tf.add_n(layer.losses)
        results.append(tape.gradient(loss, layer.kernel).numpy())
    kept, keras_grad, grad = results
    np.testing.assert_allclose(kept, 2.0 + 2.0 * np.ones((4, 3)))
    np.testing.assert_allclose(keras_grad, 2.0 * np.ones((4, 3)))  # the bug: 2*kernel lost
    np.testing.assert_array_equal(grad, kept)


def test_under_tf_function_with_keyword_arguments():
    def run(block, wrap, x):
        @tf.function
        def step():
            with tf.GradientTape() as tape:
                y = wrap(block.call)(x, training=True)
                loss = tf.reduce_sum(y * tf.range(4, dtype=y.dtype)) + tf.add_n(block.losses)
            return tape.gradient(loss, block.trainable_weights)

        try:
            return [g.numpy() for g in step()], _state(block)
        except (TypeError, ValueError) as error:
            return error

    kept, keras_result, fixed = _three_ways(run)
    assert isinstance(keras_result, Exception) and "keyword" in str(keras_result)  # the bug
    assert _worst(fixed[0], kept[0]) < 1e-6
    assert _worst(fixed[1], kept[1]) == 0.0


def test_mixed_precision_reads_are_cast_in_the_recomputation_too():
    class Projection(keras.layers.Layer):
        def build(self, shape):
            self.kernel = self.add_weight(shape=(shape[-1],), initializer="glorot_uniform")

        def call(self, x):  # the kernel read under autocasting is bfloat16
            return tf.square(tf.multiply(x, tf.convert_to_tensor(self.kernel)))

    keras.utils.set_random_seed(0)
    layer = Projection(dtype="mixed_bfloat16")
    x = tf.cast(tf.random.normal((4, 5)), "bfloat16")
    layer(x)
    results = []
    for wrap in (lambda f: f, keras_remat._KERAS_REMAT, keras_remat.remat):
        try:
            with tf.GradientTape() as tape:
                with keras.src.backend.AutocastScope("bfloat16"):  # what Layer.__call__ enters
                    y = wrap(layer.call)(x)
                loss = tf.reduce_sum(tf.cast(y, "float32"))
            results.append(tape.gradient(loss, layer.kernel).numpy())
        except Exception as error:  # noqa: BLE001 - the bug is an op's dtype error
            results.append(error)
    kept, keras_result, fixed = results
    assert isinstance(keras_result, Exception)  # the bug: a float32 kernel meets bfloat16 x
    np.testing.assert_array_equal(fixed, kept)


def test_a_model_built_under_remat_scope_trains_like_one_without(tmp_path):
    """Keras's front end, every layer recomputed (nested), under a tfdist mesh: fit equals."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.normal(size=(32, 4)).astype("float32")

    def build(scope):
        keras.utils.set_random_seed(0)
        with scope:
            inputs = keras.Input((6,))
            h = keras.layers.Dense(16, activation="relu")(inputs)
            h = keras.layers.Dropout(0.3, seed=2)(h)
            h = keras.layers.BatchNormalization()(h)
            model = keras.Model(inputs, keras.layers.Dense(4)(h))
        model.compile(keras.optimizers.Adam(0.01), "mse")
        return model

    weights, calls = [], []

    def spy(f):
        calls[-1] += 1
        return keras_remat.remat(f)

    for scope in (contextlib.nullcontext(), keras.RematScope(mode="full")):
        strategy = MeshStrategy("data:2")
        with strategy.scope():
            model = build(scope)
        calls.append(0)
        tf_core.remat = spy
        try:
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        finally:
            keras_remat.install()
        weights.append(model.get_weights())
    assert calls[0] == 0 and calls[1] >= 4  # the scoped model recomputes each layer
    assert _worst(weights[1], weights[0]) < 1e-6


def test_recomputed_layers_with_keras_training_options_match_one_device_on_a_mesh():
    """A plain model built under `RematScope` on a 2x2 mesh (MeshStrategy, the batch over
    every replica) with `global_clipnorm`, EMA with overwrite, gradient accumulation, a
    sparse `Embedding` gradient and a last batch of 4 rows: the unscoped one-device model's
    weights and optimizer variables."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 16, size=(36, 4)).astype("int32")  # 4 batches of 8, one of 4
    y = rng.normal(size=(36, 4)).astype("float32")

    def build(scope):
        keras.utils.set_random_seed(0)
        with scope:
            inputs = keras.Input((4,), dtype="int32")
            h = keras.layers.Embedding(16, 8)(inputs)
            h = keras.layers.Flatten()(keras.layers.Dense(8, activation="relu")(h))
            model = keras.Model(inputs, keras.layers.Dense(4)(h))
        model.compile(keras.optimizers.Adam(0.01, global_clipnorm=0.1, use_ema=True,
                                            ema_momentum=0.9, ema_overwrite_frequency=2,
                                            gradient_accumulation_steps=2), "mse")
        return model

    reference = build(contextlib.nullcontext())
    strategy = MeshStrategy("data:2;model:2")
    with strategy.scope():
        model = build(keras.RematScope(mode="full"))
    assert all(layer._remat_mode is not None for layer in model.layers[1:])
    for m in (model, reference):
        m.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    state = [v.numpy() for v in model.weights + model.optimizer.variables]
    expected = [v.numpy() for v in reference.weights + reference.optimizer.variables]
    assert _worst(state, expected) < 1e-5


def test_public_name():
    assert tfdist.remat(lambda x: x).__code__ is keras_remat.remat(lambda x: x).__code__


@pytest.mark.parametrize("bad", [{"remat": True}, {"remat": "blocks"}])
def test_the_transformer_option_is_validated(bad):
    from tfdist.models.transformer_layers import TransformerConfig

    with pytest.raises(ValueError, match=r"remat must be one of \['none', 'full', 'selective'\]"):
        TransformerConfig(vocab_size=8, **bad).validate()


def test_a_recomputed_calls_gradients_are_released_together():
    # The last layer's kernel gradient needs only its input, not the recomputation's read
    # of that kernel, which the first layer's gradient needs. Model averaging updates each
    # variable once its gradient exists (no all-reduce joins them), and TF did not order
    # that update after the read: the first layer's gradient saw the updated kernel in
    # some runs (tests/strategies/test_averaging.py's remat case, 2 of 6 runs wrong
    # before, 0 of 16 after). Every gradient now waits for all of them.
    first, last = keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)
    first.build((None, 5))
    last.build((None, 4))
    recomputed = keras_remat.remat(lambda x: last(first(x)))
    seen = {}

    @tf.function
    def gradients(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(recomputed(x))
        seen["first"], seen["last"] = tape.gradient(
            loss, [first.kernel.value, last.kernel.value])
        return seen["first"], seen["last"]

    gradients.get_concrete_function(tf.TensorSpec([3, 5]))
    producer = seen["first"].op
    while producer.type == "Identity":
        producer = producer.inputs[0].op
    assert producer in seen["last"].op.control_inputs, (
        producer.name, [op.name for op in seen["last"].op.control_inputs])
