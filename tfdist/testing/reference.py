"""Single-device reference twins of tfdist layers: plain Keras layers.

`reference_model(model)` rebuilds a tfdist model with each sharded layer
replaced by its twin (same name, same global weights), giving the
single-device Keras model every sharded path is compared against.
"""

import keras

from tfdist.layers import MoE, ShardedDense, ShardedEmbedding, ShardedSoftmax
from tfdist.layers.attention import ShardedAttention
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

    def __init__(self, input_dim, output_dim, embeddings_regularizer=None,
                 embeddings_constraint=None, **kwargs):
        super().__init__(**kwargs)
        self.input_dim = input_dim
        self.output_dim = output_dim
        self.embeddings_regularizer = keras.regularizers.get(embeddings_regularizer)
        self.embeddings_constraint = keras.constraints.get(embeddings_constraint)

    def build(self, input_shape=None):
        self.embeddings = self.add_weight(
            name="embeddings", shape=(self.input_dim, self.output_dim),
            regularizer=self.embeddings_regularizer, constraint=self.embeddings_constraint,
        )

    def call(self, ids):
        one_hot = keras.ops.one_hot(keras.ops.cast(ids, "int32"), self.input_dim)
        return keras.ops.matmul(one_hot, self.embeddings)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    def get_config(self):
        config = super().get_config()
        config.update(input_dim=self.input_dim, output_dim=self.output_dim,
                      embeddings_regularizer=keras.regularizers.serialize(
                          self.embeddings_regularizer),
                      embeddings_constraint=keras.constraints.serialize(
                          self.embeddings_constraint))
        return config


@keras.saving.register_keras_serializable(package="tfdist_testing")
class ReferenceAttention(keras.layers.Layer):
    """Keras's own `MultiHeadAttention` behind ShardedAttention's call signature.

    The single-device twin of `ShardedAttention` that shares no code with it:
    Keras's projections (`EinsumDense`, no biases), scaling, masked softmax and
    causal mask. Its four kernels have ShardedAttention's shapes and order
    (query, key, value `[d_model, heads, d_kv]`, output `[heads, d_kv, d_model]`).
    """

    def __init__(self, num_heads, d_kv, **kwargs):
        super().__init__(**kwargs)
        self.num_heads, self.d_kv = num_heads, d_kv
        self.attention = keras.layers.MultiHeadAttention(num_heads, key_dim=d_kv,
                                                         use_bias=False, name="mha")

    def build(self, query_shape, memory_shape=None):
        memory_shape = query_shape if memory_shape is None else memory_shape
        self.attention.build(query_shape, memory_shape)

    def call(self, query, memory=None, key_mask=None, causal=False, training=None):
        memory = query if memory is None else memory
        mask = None
        if key_mask is not None:  # [b, Lk] -> [b, Lq, Lk]
            mask = keras.ops.cast(key_mask, "bool")[:, None, :]
            mask = keras.ops.broadcast_to(
                mask, (keras.ops.shape(query)[0], keras.ops.shape(query)[1],
                       keras.ops.shape(memory)[1]))
        return self.attention(query, memory, attention_mask=mask, use_causal_mask=causal,
                              training=training)

    def compute_output_shape(self, query_shape, memory_shape=None):
        return tuple(query_shape)

    def get_config(self):
        return {**super().get_config(), "num_heads": self.num_heads, "d_kv": self.d_kv}


def reference_layer(layer):
    """The plain Keras twin of `layer` (unchanged if it is not a tfdist layer)."""
    if isinstance(layer, ShardedDense):
        return keras.layers.Dense(
            layer.units,
            activation=layer.activation,
            use_bias=layer.use_bias,
            kernel_regularizer=layer.kernel_regularizer,
            bias_regularizer=layer.bias_regularizer,
            kernel_constraint=layer.kernel_constraint,
            bias_constraint=layer.bias_constraint,
            name=layer.name,
        )
    if isinstance(layer, ShardedSoftmax):
        return keras.layers.Dense(layer.num_classes, use_bias=layer.use_bias, name=layer.name)
    if isinstance(layer, ShardedEmbedding):
        return ReferenceEmbedding(layer.input_dim, layer.output_dim,
                                  embeddings_regularizer=layer.embeddings_regularizer,
                                  embeddings_constraint=layer.embeddings_constraint,
                                  name=layer.name)
    if isinstance(layer, ShardedAttention):
        if layer.dropout:
            raise ValueError(f"The attention reference has no dropout; layer {layer.name!r} "
                             f"has dropout={layer.dropout}.")
        return ReferenceAttention(layer.num_heads, layer.d_kv, name=layer.name)
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
