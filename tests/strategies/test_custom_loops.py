"""Custom training loops: `strategy.run(step)` with `optimizer.apply_gradients`, eagerly
and in tf.function, on a mesh with no sharded weight (`data:2`).

The cases are Keras's own tf.distribute optimizer tests
(`keras/src/backend/tensorflow/optimizer_distribute_test.py`, which run them under
`MirroredStrategy(["CPU:0", "CPU:1"])`), with Keras's golden values. A tensor made
outside `strategy.run` is the same in every replica: MirroredStrategy applies it as it
is, once, and so does tfdist; a tensor made in the step is each replica's own, summed.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.optimizers import SGD

from tfdist.strategies import MeshStrategy

MODES = ["eager", "function"]


def run(strategy, mode, fn):
    if mode == "eager":
        return strategy.run(fn)
    return tf.function(lambda: strategy.run(fn))()


@pytest.mark.parametrize("mode", MODES)
def test_single_step_sums_each_replicas_gradient(mode):
    strategy = MeshStrategy("data:2")
    with strategy.scope():
        optimizer = SGD(learning_rate=0.5, momentum=0.06)
        variable = tf.Variable([1.0, 2.0, 3.0, 4.0])

    def update():
        grads = tf.constant([1.0, 6.0, 7.0, 2.0])  # each replica's own: summed
        optimizer.apply_gradients(zip([grads], [variable]))

    run(strategy, mode, update)
    np.testing.assert_allclose(variable, [0.0, -4.0, -4.0, 2.0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_weight_decay_and_its_exclusions(mode):
    strategy = MeshStrategy("data:2")
    with strategy.scope():
        grads = tf.zeros(())
        var1, var2 = keras.Variable(2.0), keras.Variable(3.0, name="exclude")
        var3 = keras.Variable(4.0)
        optimizer_1 = SGD(learning_rate=1.0, weight_decay=0.004)
        optimizer_2 = SGD(learning_rate=1.0, weight_decay=0.004)
        optimizer_3 = SGD(learning_rate=1.0, weight_decay=0.004)
    optimizer_2.exclude_from_weight_decay(var_names=["exclude"])
    optimizer_3.exclude_from_weight_decay(var_list=[var3])
    run(strategy, mode, lambda: optimizer_1.apply_gradients(zip([grads], [var1])))
    run(strategy, mode, lambda: optimizer_2.apply_gradients(zip([grads, grads], [var1, var2])))
    run(strategy, mode, lambda: optimizer_3.apply_gradients(zip([grads, grads], [var1, var3])))
    np.testing.assert_allclose(var1.numpy(), 1.9760959, rtol=1e-6)
    assert var2.numpy() == 3.0 and var3.numpy() == 4.0


@pytest.mark.parametrize("mode", MODES)
def test_nesterov_matches_keras_golden_values(mode):
    strategy = MeshStrategy("data:2")
    with strategy.scope():
        optimizer = SGD(nesterov=True)
        x = keras.Variable(np.ones([10]))
    def update(grads):  # made in the step: each replica's own, summed
        return lambda: optimizer.apply_gradients(zip([tf.constant(grads)], [x]))

    golden = np.array([[0.9980, 0.9960, 0.9940, 0.9920, 0.9900, 0.9880, 0.9860, 0.9840, 0.9820,
                        0.9800] for _ in range(5)]) - np.arange(5)[:, None] * 0.0002
    run(strategy, mode, update(np.arange(0.1, 1.1, 0.1)))
    for i in range(5):
        np.testing.assert_allclose(x, golden[i], rtol=5e-4, atol=5e-4)
        run(strategy, mode, update(np.full((10,), 0.01)))


@pytest.mark.parametrize("mode", MODES)
def test_ema_overwrites_every_third_step(mode):
    strategy = MeshStrategy("data:2")
    with strategy.scope():
        v = keras.Variable([[3.0, 4.0], [5.0, 6.0]])
        optimizer = SGD(learning_rate=1.0, use_ema=True, ema_momentum=0.9,
                        ema_overwrite_frequency=3)
    grads = tf.constant([[1.0, 1.0], [1.0, 1.0]])
    expected = [([[2.0, 3.0], [4.0, 5.0]], [[2.0, 3.0], [4.0, 5.0]]),
                ([[1.0, 2.0], [3.0, 4.0]], [[1.9, 2.9], [3.9, 4.9]]),
                ([[1.71, 2.71], [3.71, 4.71]], [[1.71, 2.71], [3.71, 4.71]])]  # overwritten
    for weights, average in expected:
        run(strategy, mode, lambda: optimizer.apply_gradients([(grads, v)]))
        np.testing.assert_allclose(v, weights, rtol=1e-6)
        np.testing.assert_allclose(optimizer._model_variables_moving_average[0], average,
                                   rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_accumulation_applies_the_mean_every_third_step(mode):
    strategy = MeshStrategy("data:2")
    with strategy.scope():
        v = keras.Variable([[1.0, 2.0], [3.0, 4.0]])
        optimizer = SGD(learning_rate=1.0, gradient_accumulation_steps=3)

    def step():  # each replica's own gradient: 2 * [[1, 1], [2, 2]] a micro-step
        optimizer.apply_gradients([(tf.constant([[1.0, 1.0], [2.0, 2.0]]), v)])

    for i in range(3):
        run(strategy, mode, step)
        assert int(optimizer.iterations.numpy()) == (i == 2)
        if i < 2:
            np.testing.assert_allclose(v, [[1.0, 2.0], [3.0, 4.0]])
            np.testing.assert_allclose(optimizer._accumulated_gradients[0],
                                       (i + 1) * np.array([[2.0, 2.0], [4.0, 4.0]]))
    np.testing.assert_allclose(v, [[-1.0, 0.0], [-1.0, 0.0]])  # Keras's golden value
    np.testing.assert_allclose(optimizer._accumulated_gradients[0], np.zeros((2, 2)))


def test_a_sharded_weight_in_an_eager_step_is_one_clear_error():
    from tfdist.layers import ShardedDense

    strategy = MeshStrategy("data:1;model:2", "d_ff:model")
    with strategy.scope():
        layer = ShardedDense(4, kernel_axes=("d_model", "d_ff"), use_bias=False)
        layer.build((None, 3))
        optimizer = SGD(0.1)
        optimizer.build([layer.kernel])

    def step():
        optimizer.apply_gradients([(tf.ones((3, 2)), layer.kernel)])

    with pytest.raises(ValueError, match=r"gets its gradient in an eager `strategy.run`.*"
                                         r"Wrap the step in tf.function"):
        strategy.run(step)
