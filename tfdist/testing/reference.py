"""Single-device reference twins of tfdist layers: plain Keras layers.

`reference_model(model)` rebuilds a tfdist model with each sharded layer
replaced by its twin (same name, same global weights), giving the
single-device Keras model every sharded path is compared against.
"""

import keras

from tfdist.layers import MoE, ShardedDense, ShardedEmbedding, ShardedSoftmax
from tfdist.testing.moe_reference import ReferenceMoE


@keras.saving.register_keras_serializable(package="tfdist_testing")
class ReferenceEmbedding(keras.layers.Layer):
    """Embedding as `one_hot(ids) @ table`: the single-device twin of ShardedEmbedding.

    Written differently on purpose (a matmul, not a gather), and, like
    ShardedEmbedding, its table gradient is dense. `keras.layers.Embedding`'s
    gradient is IndexedSlices, for which Keras optimizers such as Adam update
    moments of the looked-up rows only; a dense gradient gives the standard
    update, which is what ShardedEmbedding trains with.
    """

    def __init__(self, input_dim, output_dim, **kwargs):
        super().__init__(**kwargs)
        self.input_dim = input_dim
        self.output_dim = output_dim

    def build(self, input_shape=None):
        self.embeddings = self.add_weight(
            name="embeddings", shape=(self.input_dim, self.output_dim)
        )

    def call(self, ids):
        one_hot = keras.ops.one_hot(keras.ops.cast(ids, "int32"), self.input_dim)
        return keras.ops.matmul(one_hot, self.embeddings)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    def get_config(self):
        config = super().get_config()
        config.update(input_dim=self.input_dim, output_dim=self.output_dim)
        return config


def reference_layer(layer):
    """The plain Keras twin of `layer` (unchanged if it is not a tfdist layer)."""
    if isinstance(layer, ShardedDense):
        return keras.layers.Dense(
            layer.units,
            activation=layer.activation,
            use_bias=layer.use_bias,
            name=layer.name,
        )
    if isinstance(layer, ShardedSoftmax):
        return keras.layers.Dense(layer.num_classes, use_bias=layer.use_bias, name=layer.name)
    if isinstance(layer, ShardedEmbedding):
        return ReferenceEmbedding(layer.input_dim, layer.output_dim, name=layer.name)
    if isinstance(layer, MoE):
        if layer.second_expert_policy != "all" or layer.router_jitter or layer.dropout:
            raise ValueError(
                f"The MoE reference covers second_expert_policy='all' without jitter "
                f"or dropout; layer {layer.name!r} has "
                f"{layer.second_expert_policy!r}, {layer.router_jitter}, {layer.dropout}."
            )
        return ReferenceMoE.from_config(layer.get_config())
    return layer.__class__.from_config(layer.get_config())


def reference_model(model):
    """Clones `model` with plain Keras twins of its tfdist layers and its weights."""
    twin = keras.models.clone_model(model, clone_function=reference_layer)
    twin.set_weights(model.get_weights())
    return twin


@keras.saving.register_keras_serializable(package="tfdist_testing")
class SmoothedSparseCrossentropy(keras.losses.Loss):
    """Keras's CategoricalCrossentropy(from_logits, label_smoothing) on int labels.

    The reference for `ShardedSparseCategoricalCrossentropy` (Keras's sparse
    cross-entropy has no label smoothing).
    """

    def __init__(self, num_classes, label_smoothing=0.0, name="smoothed_sparse_ce", **kwargs):
        super().__init__(name=name, **kwargs)
        self.num_classes = num_classes
        self.label_smoothing = label_smoothing
        self._dense = keras.losses.CategoricalCrossentropy(
            from_logits=True, label_smoothing=label_smoothing, reduction=None)

    def call(self, y_true, y_pred):
        labels = keras.ops.cast(keras.ops.reshape(y_true, (-1,)), "int32")
        return self._dense(keras.ops.one_hot(labels, self.num_classes), y_pred)
