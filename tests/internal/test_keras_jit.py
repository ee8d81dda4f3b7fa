"""jit_compile=True on a plain Keras model under a multi-device mesh falls back (Keras's hook)."""

import keras
import numpy as np
import tensorflow as tf

from tfdist.internal import keras_jit
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import max_rel_diff


def _plain_model():
    keras.utils.set_random_seed(0)
    x = inputs = keras.Input((8,))
    return keras.Model(inputs, keras.layers.Dense(4)(keras.layers.Dense(16, activation="relu")(x)))


def test_the_keras_hook_still_exists():
    from keras.src.trainers import trainer

    MeshStrategy("data:2")  # every tfdist mesh strategy installs the hook
    assert keras_jit.installed()
    assert keras_jit._KERAS_MODEL_SUPPORTS_JIT.__module__ == trainer.__name__


def test_a_plain_model_with_jit_compile_trains_on_a_multi_device_mesh_like_one_device():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 4)).astype("float32")
    strategy = MeshStrategy("data:4")
    with strategy.scope():
        model = _plain_model()
        model.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=True)
    assert model.jit_compile is False  # fell back instead of failing to XLA-compile
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    reference = _plain_model()
    reference.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=True)
    assert reference.jit_compile is True  # one device: Keras's own decision
    reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert max(max_rel_diff(a, b) for a, b in zip(model.get_weights(),
                                                  reference.get_weights())) < 1e-5
    single = MeshStrategy("data:1")
    with single.scope():
        one = _plain_model()
        one.compile("sgd", "mse", jit_compile=True)
    assert one.jit_compile is True and tf.config.list_logical_devices("CPU")
