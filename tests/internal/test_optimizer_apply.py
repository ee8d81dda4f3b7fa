"""Keras's updates inside a cond (accumulation, EMA overwrite) under a tfdist mesh.

The upstream failure first: under tf.distribute's MirroredStrategy, Keras's
`gradient_accumulation_steps` fails, because the update inside `ops.cond`
needs a merge call. tfdist runs the same cond in cross-replica context
(`tfdist.internal.optimizer_apply`); the equivalence with one device is in
tests/strategies/test_optimizers.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.internal import optimizer_apply
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import max_rel_diff


def _data():
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    return x, x[:, :2] * 2.0


def _fit(strategy, **options):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.1, **options), "mse")
    model.fit(*_data(), batch_size=8, shuffle=False, verbose=0)
    return model.get_weights()


def test_the_keras_hook_still_exists():
    from keras.src.optimizers import base_optimizer

    MeshStrategy("data:2")  # every tfdist mesh strategy installs the hook
    assert optimizer_apply.installed()
    assert optimizer_apply._KERAS_APPLY is base_optimizer.BaseOptimizer._backend_apply_gradients


def test_upstream_mirrored_strategy_cannot_accumulate_gradients():
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    mirrored = tf.distribute.MirroredStrategy(
        cpus, cross_device_ops=tf.distribute.ReductionToOneDevice())
    with pytest.raises(RuntimeError, match="merge_call"):
        _fit(mirrored, gradient_accumulation_steps=2)


@pytest.mark.parametrize("options", [{"gradient_accumulation_steps": 2},
                                     {"use_ema": True, "ema_overwrite_frequency": 2}])
def test_a_tfdist_mesh_trains_them_like_one_device(options):
    one = _fit(tf.distribute.get_strategy(), **options)
    mesh = _fit(MeshStrategy("data:2"), **options)
    assert max(max_rel_diff(a, b) for a, b in zip(mesh, one)) < 1e-6
