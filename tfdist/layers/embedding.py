"""ShardedEmbedding: an embedding table split over the vocabulary.

With the rule `vocab:A` (A of size M) each device holds rows
`[m * V/M, (m + 1) * V/M)` of the `[vocab, d_model]` table. A replica gathers
the ids of its group along A, looks up the ids it owns (zeros elsewhere), and
reduce-scatters the partial embeddings back to its own rows of the batch:

    ids [b, ...] -> all_gather -> [b*M, ...] -> local lookup -> [b*M, ..., d_model]
                 -> reduce_scatter over A -> [b, ..., d_model]

The table's gradient is dense per shard (a segment sum), so the optimizer
never sees IndexedSlices.
"""

import keras
import tensorflow as tf

from tfdist import collectives, tensor_parallel
from tfdist.layers.weights import (
    add_sharded_weight,
    check_mesh,
    check_axes,
    check_positive_int,
    disable_jit_on_multi_device_mesh,
    sharded_mesh_axis,
)


def dense_gather(table, ids):
    """`tf.gather(table, ids)` whose gradient for `table` is a dense tensor."""

    @tf.custom_gradient
    def gather(table):
        def grad(dy):
            flat_ids = tf.reshape(ids, [-1])
            flat_dy = tf.reshape(dy, [-1, tf.shape(table)[-1]])
            return tf.math.unsorted_segment_sum(flat_dy, flat_ids, tf.shape(table)[0])

        return tf.gather(table, ids), grad

    return gather(tf.convert_to_tensor(table))


@keras.saving.register_keras_serializable(package="tfdist")
class ShardedEmbedding(keras.layers.Layer):
    """Token embedding whose table `[vocab, d_model]` is split over `vocab`.

    Args:
        input_dim: vocabulary size `vocab`.
        output_dim: embedding size `d_model`.
        embeddings_axes: logical axes of the table; the rules may split the
            first (vocabulary) one.
        embeddings_initializer: Keras initializer for the global table.
        embeddings_regularizer, embeddings_constraint: Keras regularizer and
            constraint (on a split table: see `add_sharded_weight`).

    Input shape: integer ids `[batch, ...]`.
    Output shape: `[batch, ..., output_dim]`.

    Example:

    ```python
    embed = ShardedEmbedding(32000, 512)   # with "vocab:model": 1/M of the table per device
    h = embed(token_ids)
    ```
    """

    def __init__(
        self,
        input_dim,
        output_dim,
        embeddings_axes=("vocab", "d_model"),
        embeddings_initializer="uniform",
        embeddings_regularizer=None,
        embeddings_constraint=None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.input_dim = check_positive_int("input_dim", input_dim)
        self.output_dim = check_positive_int("output_dim", output_dim)
        self.embeddings_axes = check_axes("embeddings_axes", embeddings_axes, ("vocab", "d_model"))
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)
        self.embeddings_constraint = keras.constraints.get(embeddings_constraint)
        self.weight_layouts = {}
        disable_jit_on_multi_device_mesh(self)

    def build(self, input_shape=None):
        self.embeddings = add_sharded_weight(
            self,
            "embeddings",
            (self.input_dim, self.output_dim),
            self.embeddings_axes,
            initializer=self.embeddings_initializer,
            regularizer=self.embeddings_regularizer,
            constraint=self.embeddings_constraint,
        )
        layout = self.weight_layouts["embeddings"]
        if sharded_mesh_axis(layout, 1) is not None:
            raise ValueError(
                f"Layer {self.name!r}: table {layout} is split over its embedding "
                f"dimension; ShardedEmbedding splits only the vocabulary."
            )
        self._vocab_axis = sharded_mesh_axis(layout, 0)

    def call(self, inputs):
        check_mesh(self)
        ids = tf.cast(inputs, "int32")
        axis = self._vocab_axis
        if axis is None:
            return dense_gather(self.embeddings, ids)
        first = collectives.axis_index(axis) * (self.input_dim // collectives.axis_size(axis))
        return tensor_parallel.vocab_split(ids, axis, lambda ids_all: tensor_parallel.held_rows(
            self.embeddings, ids_all - first, dense_gradient=True))  # [b, ..., d]

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    def get_config(self):
        config = super().get_config()
        config.update(
            input_dim=self.input_dim,
            output_dim=self.output_dim,
            embeddings_axes=list(self.embeddings_axes),
            embeddings_initializer=keras.initializers.serialize(
                self.embeddings_initializer
            ),
            embeddings_regularizer=keras.regularizers.serialize(self.embeddings_regularizer),
            embeddings_constraint=keras.constraints.serialize(self.embeddings_constraint),
        )
        return config
