"""The private Keras hooks behind partial batches: losses, compiled metrics, the loss tracker.

Each is checked on real Keras objects inside a hand-made `Rows` context (a
replica of 4 padded rows, 3 of them real, in a step of 10 real rows) and
outside one (Keras's own result). If a Keras upgrade moves `reduce_values`
or `CompileMetrics`' internals, these fail first.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist import batch_rows
from tfdist.internal import keras_rows

keras_rows.install()

MASK = tf.constant([1.0, 1.0, 1.0, 0.0])
ROWS = batch_rows.Rows(MASK, tf.constant(3), tf.constant(4), tf.constant(10.0))
Y = np.array([[1, 0], [0, 1], [1, 1], [0, 0]], "float32")
P = np.array([[0.5, 0.0], [0.0, 0.5], [2.0, 1.0], [9.0, 9.0]], "float32")
SQUARES = ((Y - P) ** 2)[:3]  # the real rows' squared errors


def test_mean_losses_are_this_replicas_share_of_the_steps_mean():
    mse = keras.losses.MeanSquaredError()
    assert mse(Y, P).numpy() == pytest.approx(((Y - P) ** 2).mean())  # Keras's own
    with batch_rows.replica_rows(ROWS):
        share = mse(Y, P).numpy()
    assert share == pytest.approx(SQUARES.mean(axis=1).sum() / 10.0)


def test_sum_losses_drop_the_padding_and_scalar_losses_need_even_replicas():
    with batch_rows.replica_rows(ROWS):
        total = keras.losses.MeanSquaredError(reduction="sum")(Y, P).numpy()
        assert total == pytest.approx(SQUARES.mean(axis=1).sum())
        with pytest.raises(tf.errors.InvalidArgumentError, match="returned a scalar"):
            keras_rows.reduce_values(tf.constant(2.0))
    even = batch_rows.Rows(tf.ones([4]), tf.constant(4), tf.constant(4), tf.constant(4.0))
    with batch_rows.replica_rows(even):
        assert keras_rows.reduce_values(tf.constant(2.0)).numpy() == 2.0


def test_compiled_metrics_count_only_real_rows_weighted_or_not():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse", metrics=[keras.metrics.MeanAbsoluteError(name="mae")],
                  weighted_metrics=[keras.metrics.MeanAbsoluteError(name="w_mae")])
    model.compute_metrics(None, Y, P)  # builds them
    for m in model.metrics:
        m.reset_state()
    weights = np.array([2.0, 1.0, 1.0, 5.0], "float32")
    with batch_rows.replica_rows(ROWS):
        model._compile_metrics.update_state(Y, P, weights)
    errors = np.abs(Y - P).mean(axis=1)[:3]
    result = model._compile_metrics.result()
    assert float(result["mae"]) == pytest.approx(errors.mean())
    assert float(result["w_mae"]) == pytest.approx((errors * weights[:3]).sum() / weights[:3].sum())


def test_the_loss_tracker_weights_a_step_by_its_real_rows_over_the_replicas():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    keras_rows.track_real_rows(model)
    keras_rows.track_real_rows(model)  # idempotent
    model._loss_tracker.update_state(1.0, sample_weight=8)  # a full step of 8 rows
    with batch_rows.replica_rows(ROWS):
        model._loss_tracker.update_state(4.0, sample_weight=4)  # 10 real rows, one replica
    assert model._loss_tracker.result().numpy() == pytest.approx((8 * 1.0 + 10 * 4.0) / 18)
