"""mixed_float16: an overflow on one replica skips the step on all, as on one device."""

import keras
import numpy as np
import pytest

from tfdist.internal import loss_scale
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import max_rel_diff


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 4)).astype("float32")
    x[8:16] = 3e4  # batch 0, replica 1's rows on data:2: float16 overflows there only
    return x, y


def _train(strategy=None):
    keras.utils.set_random_seed(0)
    with strategy.scope() if strategy else keras.name_scope("one"):
        inputs = keras.Input((8,))
        h = keras.layers.Dense(16, activation="relu")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(4, dtype="float32")(h))
        model.compile(keras.optimizers.SGD(0.01), "mse")  # wrapped in a LossScaleOptimizer
    x, y = _data()
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    return model


def test_the_seam_sets_the_global_check_on_the_optimizer_not_its_class(mixed_float16):
    with MeshStrategy("data:2").scope():
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    assert optimizer.check_finite.__func__ is loss_scale.check_finite
    assert "check_finite" not in vars(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()))


def test_an_overflow_on_one_replica_skips_the_step_everywhere(mixed_float16):
    one = _train()
    mesh = _train(MeshStrategy("data:2"))
    assert type(mesh.optimizer).__name__ == "LossScaleOptimizer"
    # Step 0 overflowed (on replica 1 only): skipped and the scale halved, as on one device.
    assert float(mesh.optimizer.dynamic_scale.numpy()) == float(one.optimizer.dynamic_scale.numpy())
    assert float(one.optimizer.dynamic_scale.numpy()) < 32768.0
    for a, b in zip(mesh.get_weights(), one.get_weights()):
        assert np.isfinite(a).all()
        assert max_rel_diff(a, b) < 1e-3  # float16 compute
