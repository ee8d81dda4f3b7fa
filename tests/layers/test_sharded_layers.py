"""ShardedDense and ShardedEmbedding: arguments, config, single-device behaviour."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.layers import ShardedDense, ShardedEmbedding
from tfdist.strategies import MeshStrategy


@pytest.mark.parametrize(
    "layer",
    [
        ShardedDense(6, ("d_ff", "d_model"), activation="relu", use_bias=False,
                     input_sharded=True, kernel_initializer="ones", name="d"),
        ShardedDense(4, output_sharded=True, bias_initializer="ones"),
        ShardedEmbedding(10, 3, embeddings_initializer="ones", name="e"),
    ],
)
def test_config_round_trip(layer):
    config = layer.get_config()
    clone = layer.__class__.from_config(config)
    assert clone.get_config() == config


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda: ShardedDense(-1), "units=-1"),
        (lambda: ShardedDense(2.5), "units=2.5"),
        (lambda: ShardedDense(4, kernel_axes=("d_model",)), "kernel_axes=('d_model',)"),
        (lambda: ShardedEmbedding(0, 4), "input_dim=0"),
        (lambda: ShardedEmbedding(4, -3), "output_dim=-3"),
        (lambda: ShardedEmbedding(4, 3, embeddings_axes=("vocab",)), "embeddings_axes=('vocab',)"),
    ],
)
def test_bad_arguments_are_rejected_at_construction(make, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_single_device_dense_matches_keras_dense():
    x = np.random.default_rng(0).normal(size=(3, 5, 4)).astype("float32")
    layer = ShardedDense(6, activation="tanh")
    twin = keras.layers.Dense(6, activation="tanh")
    layer.build(x.shape)
    twin.build(x.shape)
    twin.set_weights(layer.get_weights())
    np.testing.assert_allclose(layer(x), twin(x), rtol=1e-6)


def test_embedding_gradient_is_dense_and_matches_one_hot():
    layer = ShardedEmbedding(7, 3)
    ids = tf.constant([[1, 2, 1], [6, 0, 1]])
    layer.build(ids.shape)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(ids) * tf.range(3, dtype=tf.float32))
    grad = tape.gradient(loss, layer.embeddings.value)
    assert isinstance(grad, tf.Tensor)
    expected = np.zeros((7, 3), "float32")
    for i in ids.numpy().ravel():
        expected[i] += np.arange(3)
    np.testing.assert_allclose(grad.numpy(), expected)


def test_kernel_split_on_both_dims_is_rejected():
    strategy = MeshStrategy("data:2;model:2", "d_model:data;d_ff:model")
    with strategy.scope():
        layer = ShardedDense(4, ("d_model", "d_ff"), name="ffn")
        with pytest.raises(ValueError, match="split on both dimensions"):
            layer.build((None, 4))


def test_embedding_split_over_d_model_is_rejected():
    strategy = MeshStrategy("data:1;model:2", "d_model:model")
    with strategy.scope():
        layer = ShardedEmbedding(8, 4, name="embed")
        with pytest.raises(ValueError, match="splits only the vocabulary"):
            layer.build((None, 3))


def test_weight_layouts_record_the_mesh_mapping():
    strategy = MeshStrategy("data:2;model:2", "d_ff:model")
    with strategy.scope():
        layer = ShardedDense(8, ("d_model", "d_ff"))
        layer.build((None, 4))
    assert layer.weight_layouts["kernel"].mesh_axes == (None, "model")
    assert layer.weight_layouts["kernel"].local_shape == (4, 4)
    assert layer.weight_layouts["bias"].mesh_axes == ("model",)


def test_row_parallel_input_moves_by_all_to_all_not_an_all_gather_of_the_rows():
    # [b, L, d_in] = [4, 3, 16] per replica, d_in split over model:4. The input's
    # exchange sends each device's 4*3*16 values as 4 parts of 4*3*4 (an all-gather of
    # the rows and a slice moved each device's whole rows to every peer: 4x the bytes).
    from tfdist.testing.collective_log import recorded

    strategy = MeshStrategy("data:1;model:4", "d_ff:model")
    with strategy.scope():
        layer = ShardedDense(8, kernel_axes=("d_ff", "d_model"))
        layer.build((None, 3, 16))
    x = tf.data.Dataset.from_tensor_slices(np.ones((16, 3, 16), "float32")).batch(16)
    with recorded(strategy, "all_gather") as gathers, recorded(strategy, "all_to_all") as a2a:
        batch = next(iter(strategy.experimental_distribute_dataset(x)))
        strategy.run(tf.function(layer), args=(batch,))
    assert gathers == []
    # Each of the 4 replicas: M parts of [b, L, d_in / M] (3/4 of them leave), then the
    # partial sums' reduce-scatter, M parts of [b, L, d_out].
    assert sorted(a2a) == [(4, 4, 3, 4)] * 4 + [(4, 4, 3, 8)] * 4
