"""The gradient seam: attached to each optimizer created under a tfdist strategy, no class patched.

The upstream failure first: under tf.distribute's MirroredStrategy, Keras's
`gradient_accumulation_steps` fails, because the update inside `ops.cond`
needs a merge call. tfdist's seam runs the same cond in cross-replica context
(`tfdist.internal.gradient_seam`); the equivalence with one device over every
option is in tests/strategies/test_optimizers.py.
"""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow import optimizer as tf_optimizer
from keras.src.optimizers import base_optimizer, lamb, loss_scale_optimizer

from tfdist.internal import gradient_seam, keras_lamb, loss_scale
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import max_rel_diff


def _data():
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    return x, x[:, :2] * 2.0


def _fit(strategy, optimizer=None, **options):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        model.compile(optimizer() if optimizer else keras.optimizers.SGD(0.1, **options), "mse")
    model.fit(*_data(), batch_size=8, shuffle=False, verbose=0)
    return model


def test_no_keras_class_is_patched():
    MeshStrategy("data:2")
    assert "_backend_apply_gradients" not in vars(tf_optimizer.TFOptimizer)
    assert inspect.getmodule(base_optimizer.BaseOptimizer._backend_apply_gradients) \
        is base_optimizer
    assert inspect.getmodule(lamb.Lamb.update_step) is lamb
    assert inspect.getmodule(
        loss_scale_optimizer.LossScaleOptimizer.check_finite) is loss_scale_optimizer


def test_the_seam_is_attached_to_each_optimizer_created_under_a_tfdist_strategy():
    strategy = MeshStrategy("data:2")
    with strategy.scope():
        adam, lamb_opt = keras.optimizers.Adam(), keras.optimizers.Lamb()
        scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    plain = keras.optimizers.Adam()  # outside: Keras's own
    for optimizer in (adam, lamb_opt, scaled, scaled.inner_optimizer):
        seam = gradient_seam.seam_of(optimizer)
        assert seam is not None and seam.strategy is strategy
        assert optimizer._backend_apply_gradients == seam.apply_gradients
    assert gradient_seam.seam_of(plain) is None
    assert "_backend_apply_gradients" not in vars(plain)
    assert lamb_opt.update_step.__func__ is keras_lamb.update_step
    assert "update_step" not in vars(adam)
    assert scaled.check_finite.__func__ is loss_scale.check_finite


def test_the_users_optimizer_stays_theirs(tmp_path):
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5)
    model = _fit(MeshStrategy("data:2"), lambda: keras.optimizers.Adam(schedule))
    optimizer = model.optimizer
    assert type(optimizer) is keras.optimizers.Adam
    assert int(optimizer.iterations.numpy()) == 4
    config = optimizer.get_config()
    assert config["learning_rate"]["class_name"] == "ExponentialDecay"
    assert "_backend_apply_gradients" not in str(config)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is keras.optimizers.Adam
    assert int(loaded.optimizer.iterations.numpy()) == 4
    for a, b in zip(loaded.optimizer.variables, optimizer.variables):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_seam_makes_one_merge_call_per_step_without_ema():
    strategy = MeshStrategy("data:2")
    calls = []
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.1), "mse")
    seam = gradient_seam.seam_of(model.optimizer)
    step = seam._step
    seam._step = lambda *args: calls.append(1) or step(*args)
    model.fit(*_data(), batch_size=8, epochs=1, steps_per_epoch=2, verbose=0)
    assert calls == [1]  # traced once: one merge call in the step's graph


def test_upstream_mirrored_strategy_cannot_accumulate_gradients():
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    mirrored = tf.distribute.MirroredStrategy(
        cpus, cross_device_ops=tf.distribute.ReductionToOneDevice())
    with pytest.raises(RuntimeError, match="merge_call"):
        _fit(mirrored, gradient_accumulation_steps=2)


@pytest.mark.parametrize("options", [{}, {"gradient_accumulation_steps": 2},
                                     {"use_ema": True, "ema_overwrite_frequency": 2}])
def test_a_tfdist_mesh_trains_them_like_one_device(options):
    one = _fit(tf.distribute.get_strategy(), **options).get_weights()
    mesh = _fit(MeshStrategy("data:2"), **options).get_weights()
    assert max(max_rel_diff(a, b) for a, b in zip(mesh, one)) < 1e-6


def test_keras_update_step_still_hands_the_pairs_through_in_cross_replica_context():
    source = inspect.getsource(tf_optimizer.TFOptimizer._backend_update_step)
    assert "self._all_reduce_sum_gradients(grads_and_vars)" in source
    source = inspect.getsource(tf_optimizer.TFOptimizer._all_reduce_sum_gradients)
    assert "if not replica_context:\n            return grads_and_vars" in source
