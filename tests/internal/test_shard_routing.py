"""The private TF hooks tfdist relies on, and 2-D sharding, checked directly.

If a TF upgrade renames or removes one of these hooks, these tests fail first.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute import mirrored_strategy, values

from tfdist.core.shards import assemble_global
from tfdist.internal.shard_routing import ShardedVariable
from tfdist.layers import add_sharded_weight
from tfdist.mesh import Mesh
from tfdist.strategies import MeshStrategy


def test_private_hooks_still_exist():
    for name in ("_create_variable", "_batch_reduce_to", "_reduce_to", "_update",
                 "_use_merge_call", "_call_for_each_replica"):
        assert callable(getattr(mirrored_strategy.MirroredExtended, name)), name
    for name in ("_get_cross_replica", "_update_cross_replica", "_update_replica",
                 "_get_on_device_or_primary", "_serialize_to_tensors", "_restore_from_tensors"):
        assert callable(getattr(values.MirroredVariable, name)), name


def test_assemble_global_on_two_sharded_dims():
    mesh = Mesh.parse("data:2;model:4", "d_model:data;d_ff:model")
    layout = mesh.tensor_layout(("d_model", "d_ff"), (4, 8))
    full = np.arange(32, dtype="float32").reshape(4, 8)
    shards = [tf.constant(full[layout.shard_slices(i)]) for i in range(8)]
    np.testing.assert_array_equal(assemble_global(layout, shards).numpy(), full)


class _Block(keras.layers.Layer):
    def build(self, input_shape):
        self.w = add_sharded_weight(self, "w", (4, 8), ("d_model", "d_ff"),
                                    initializer=keras.initializers.Constant(
                                        np.arange(32).reshape(4, 8)))

    def call(self, x):
        return x


def test_two_dim_sharded_variable_reads_and_assigns_globally():
    strategy = MeshStrategy("data:2;model:4", "d_model:data;d_ff:model")
    with strategy.scope():
        block = _Block()
        block.build(None)
    var = block.w.value
    assert isinstance(var, ShardedVariable)
    assert [tuple(c.shape) for c in var.values] == [(2, 2)] * 8
    full = np.arange(32, dtype="float32").reshape(4, 8)
    np.testing.assert_array_equal(block.w.numpy(), full)
    np.testing.assert_array_equal(var.values[5].numpy(), full[2:4, 2:4])  # data=1, model=1
    block.w.assign(full * 2)
    np.testing.assert_array_equal(var.values[7].numpy(), full[2:4, 6:8] * 2)
    block.w.assign_add(np.ones((4, 8), "float32"))
    np.testing.assert_array_equal(block.w.numpy(), full * 2 + 1)


def test_assigning_a_wrong_global_shape_names_it():
    strategy = MeshStrategy("data:1;model:2", "d_ff:model")
    with strategy.scope():
        block = _Block()
        block.build(None)
    try:
        block.w.value.assign(np.zeros((4, 4), "float32"))
    except ValueError as e:
        assert "global shape (4, 8)" in str(e)
    else:
        raise AssertionError("expected a ValueError")


class _Padded(keras.layers.Layer):
    def build(self, input_shape):
        self.w = add_sharded_weight(self, "w", (2, 7), ("d_model", "classes"), pad=True,
                                    initializer=keras.initializers.Constant(
                                        np.arange(14).reshape(2, 7)))

    def call(self, x):
        return x


def test_padded_sharded_variable_hides_its_padding():
    strategy = MeshStrategy("data:1;model:4", "classes:model")
    with strategy.scope():
        layer = _Padded()
        layer.build(None)
    var = layer.w.value
    assert [tuple(c.shape) for c in var.values] == [(2, 2)] * 4
    full = np.arange(14, dtype="float32").reshape(2, 7)
    np.testing.assert_array_equal(layer.w.numpy(), full)
    np.testing.assert_array_equal(var.values[3].numpy(), [[6, 0], [13, 0]])
    layer.w.assign(full + 1)
    np.testing.assert_array_equal(var.values[3].numpy(), [[7, 0], [14, 0]])
    np.testing.assert_array_equal(layer.w.numpy(), full + 1)


class _BlockWithBias(_Block):
    def build(self, input_shape):
        super().build(input_shape)
        self.b = self.add_weight(name="b", shape=(3,), initializer="zeros")


def _replica_scaled_step(strategy, block, apply):
    """In replica r, the gradient of every weight is r + 1 everywhere."""

    @tf.function
    def step():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            scale = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
            weights = [block.w, block.b]
            with tf.GradientTape() as tape:
                loss = sum(tf.reduce_sum(tf.convert_to_tensor(w.value) * scale) for w in weights)
            apply(tape.gradient(loss, [w.value for w in weights]), weights)

        strategy.run(replica_fn)

    step()


def test_keras_optimizer_routes_each_gradient_by_its_variable():
    strategy = MeshStrategy("data:2;model:2", "d_ff:model")
    with strategy.scope():
        block = _BlockWithBias()
        block.build(None)
        optimizer = keras.optimizers.SGD(1.0)
        optimizer.build([block.w, block.b])
    _replica_scaled_step(strategy, block,
                         lambda grads, weights: optimizer.apply(grads, weights))
    full = np.arange(32, dtype="float32").reshape(4, 8)
    # Shard model=0 lives on devices 0 and 2 (replicas 1 + 3), model=1 on 1 and 3 (2 + 4).
    np.testing.assert_allclose(block.w.numpy(), full - np.repeat([[4.0, 6.0]], 4, axis=1))
    np.testing.assert_allclose(block.b.numpy(), np.full(3, -10.0))  # 1 + 2 + 3 + 4


def test_a_sharded_weight_updated_from_an_unrouted_gradient_raises():
    strategy = MeshStrategy("data:2;model:2", "d_ff:model")
    with strategy.scope():
        block = _BlockWithBias()
        block.build(None)

    def all_reduced_by_hand(grads, weights):
        grads = tf.distribute.get_replica_context().all_reduce("SUM", grads)

        def update(strategy, grads):
            for g, w in zip(grads, weights):
                strategy.extended.update(w.value, lambda v, g: v.assign_sub(g), args=(g,))

        tf.distribute.get_replica_context().merge_call(update, args=(grads,))

    with pytest.raises(ValueError, match="did not route"):
        _replica_scaled_step(strategy, block, all_reduced_by_hand)
