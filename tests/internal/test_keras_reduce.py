"""The Keras 3 calls behind `tfdist.internal.keras_reduce` (keras#20585).

If Keras stops calling `strategy.reduce` with the nested first batch (or the
workaround stops answering its calls), these tests fail first. The full
multi-worker `fit` runs in `tests/cluster/test_multi_worker.py`.
"""

import keras
import numpy as np
import tensorflow as tf

from tfdist.internal.keras_reduce import reduce_for_keras


def _two_cpus():
    # Reduction through one device: TF's collectives would share instance keys with any
    # other MirroredStrategy of this test process ("Shape mismatch in the collective").
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                          cross_device_ops=tf.distribute.ReductionToOneDevice())


def test_keras_fit_reduces_the_nested_first_batch_with_axis_none():
    strategy = _two_cpus()
    calls = []
    reduce = strategy.reduce

    def recording(reduce_op, value, axis):
        calls.append((reduce_op, value, axis))
        return reduce_for_keras(reduce, strategy, reduce_op, value, axis)

    strategy.reduce = recording
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    data = tf.data.Dataset.from_tensor_slices(
        (np.ones((8, 3), "float32"), np.array([0, 1] * 4, "int32"))).batch(4)
    model.fit(data, epochs=1, verbose=0)
    nested = [(op, value) for op, value, axis in calls if axis is None and isinstance(value, tuple)]
    assert nested, f"Keras's fit no longer reduces the nested first batch: {calls}"
    assert nested[0][0] == "MEAN"
    assert all(isinstance(v, tf.distribute.DistributedValues) for v in nested[0][1])


def test_nest_is_answered_locally_and_a_scalar_axis_0_means_over_replicas():
    strategy = _two_cpus()
    batch = strategy.experimental_distribute_values_from_function(
        lambda ctx: (tf.fill([2, 3], float(ctx.replica_id_in_sync_group)),
                     tf.constant([1, 2]) * (ctx.replica_id_in_sync_group + 1)))
    features, labels = reduce_for_keras(strategy.reduce, strategy, "MEAN", batch, None)
    np.testing.assert_array_equal(features.numpy(), np.zeros((2, 3)))
    np.testing.assert_array_equal(labels.numpy(), [1, 2])  # replica 0's, not a mean of ints

    loss = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(float(ctx.replica_id_in_sync_group) + 1.0))
    np.testing.assert_allclose(
        reduce_for_keras(strategy.reduce, strategy, "MEAN", loss, 0).numpy(), 1.5)
    rows = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.fill([2], float(ctx.replica_id_in_sync_group)))
    np.testing.assert_allclose(
        reduce_for_keras(strategy.reduce, strategy, "MEAN", rows, 0).numpy(), 0.5)
