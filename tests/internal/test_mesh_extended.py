"""The private TF hooks tfdist relies on, and 2-D sharding, checked directly.

If a TF upgrade renames or removes one of these hooks, these tests fail first.
"""

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import mirrored_strategy, values

from tfdist.internal.mesh_extended import ShardedVariable, assemble_global
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


def test_marked_shard_gradients_skip_the_global_all_reduce():
    strategy = MeshStrategy("data:2;model:2", "d_ff:model")
    with strategy.scope():
        block = _Block()
        block.build(None)
    var = block.w.value  # [4, 8] split over model: (4, 4) per device

    @tf.function
    def step():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            scale = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.convert_to_tensor(var) * scale)
            grad = tape.gradient(loss, var)
            tied = grad * 1.0  # loses the mark: reduced over all replicas
            return ctx.all_reduce("SUM", [grad, tied])

        return strategy.run(replica_fn)

    marked, unmarked = step()
    for i, (m, u) in enumerate(zip(strategy.experimental_local_results(marked),
                                   strategy.experimental_local_results(unmarked))):
        np.testing.assert_allclose(m.numpy(), np.full((4, 4), i + 1.0))  # untouched
        np.testing.assert_allclose(u.numpy(), np.full((4, 4), 10.0))  # 1 + 2 + 3 + 4
