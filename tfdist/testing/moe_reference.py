"""A single-device MoE written differently: a per-token loop over chosen experts.

No dispatch or combine tensors, no cumsum: for each group it walks the tokens in
order, keeps a running count of tokens per expert, admits a token's top-1
choice while its expert has room, then walks them again for top-2 choices, and
adds `gate * FFN_e(token)` for each admitted choice. Same weights and gates as
`tfdist.layers.MoE` (policy `all`, no jitter, no dropout).
"""

import keras
import tensorflow as tf

from tfdist.layers.moe import expert_capacity


def add_expert_weights(layer, input_shape):
    """The MoE's weights, in its order: router `[M, E]`, wi `[E, M, H]`, wo `[E, H, M]`."""
    d_model = int(input_shape[-1])
    E, H = layer.num_experts, layer.d_ff
    layer.router = layer.add_weight(name="router", shape=(d_model, E))
    layer.wi = layer.add_weight(name="wi", shape=(E, d_model, H))
    layer.wo = layer.add_weight(name="wo", shape=(E, H, d_model))


@keras.saving.register_keras_serializable(package="tfdist_testing")
class ReferenceMoE(keras.layers.Layer):
    """The per-token-loop twin of `tfdist.layers.MoE` (takes the same config)."""

    def __init__(self, num_experts, d_ff, top_k=2, capacity_factor=1.25,
                 eval_capacity_factor=2.0, min_capacity=4, group_size=1024,
                 aux_loss_coef=1e-2, z_loss_coef=0.0, activation="relu", **kwargs):
        for unsupported in ("second_expert_policy", "second_expert_threshold",
                            "router_jitter", "dropout", "seed", "hidden_axis"):
            kwargs.pop(unsupported, None)
        super().__init__(**kwargs)
        self.num_experts, self.d_ff, self.top_k = num_experts, d_ff, top_k
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity, self.group_size = min_capacity, group_size
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.activation = keras.activations.get(activation)

    def build(self, input_shape):
        add_expert_weights(self, input_shape)

    def _expert(self, e, x):
        """FFN of expert `e` (an int32 scalar tensor) on one token `x [M]`."""
        pick = tf.one_hot(e, self.num_experts)  # dense gradients, unlike a gather
        wi = tf.tensordot(pick, self.wi, axes=1)  # [M, H]
        wo = tf.tensordot(pick, self.wo, axes=1)  # [H, M]
        return tf.linalg.matvec(wo, self.activation(tf.linalg.matvec(wi, x, transpose_a=True)),
                                transpose_a=True)

    def call(self, inputs, training=False):
        x = tf.convert_to_tensor(inputs)
        d_model = x.shape[-1]
        tokens = tf.reshape(x, [-1, d_model])
        num_tokens, S, E = tokens.shape[0], self.group_size, self.num_experts
        factor = self.capacity_factor if training else self.eval_capacity_factor
        capacity = expert_capacity(S, E, self.top_k, factor, self.min_capacity)
        outputs, aux_terms, z_terms = [], [], []
        for g in range(num_tokens // S):
            group = tokens[g * S:(g + 1) * S]
            logits = tf.matmul(group, self.router)  # [S, E]
            probs = tf.nn.softmax(logits)
            z_terms.append(tf.reduce_mean(tf.square(tf.reduce_logsumexp(logits, axis=-1))))
            first = tf.argmax(probs, axis=-1, output_type=tf.int32)
            second = tf.argmax(probs - 2.0 * tf.one_hot(first, E), axis=-1, output_type=tf.int32)
            aux_terms.append(tf.reduce_mean(
                tf.reduce_mean(tf.one_hot(first, E), 0) * tf.reduce_mean(probs, 0)) * E * E)
            choices = [first] + ([second] if self.top_k == 2 else [])
            p1 = tf.gather(probs, first, batch_dims=1)
            p2 = tf.gather(probs, second, batch_dims=1)
            gates = [p1] if self.top_k == 1 else [p1 / (p1 + p2 + 1e-9), p2 / (p1 + p2 + 1e-9)]
            count = tf.zeros([E])
            out = [tf.zeros([d_model]) for _ in range(S)]
            for choice, gate in zip(choices, gates):  # all top-1 choices before any top-2
                for s in range(S):
                    e = choice[s]
                    admitted = tf.cast(tf.gather(count, e) < capacity, tf.float32)
                    count += tf.one_hot(e, E) * admitted
                    out[s] = out[s] + admitted * gate[s] * self._expert(e, group[s])
            outputs.append(tf.stack(out))
        aux = tf.add_n(aux_terms) / len(aux_terms)
        z = tf.add_n(z_terms) / len(z_terms)
        self.add_loss(self.aux_loss_coef * aux + self.z_loss_coef * z)
        return tf.reshape(tf.concat(outputs, axis=0), tf.shape(x))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)


@keras.saving.register_keras_serializable(package="tfdist_testing")
class NoDropReferenceMoE(keras.layers.Layer):
    """Every expert on every token, mixed by the top-k gates: the MoE when no token is dropped.

    Written without groups, capacity or dispatch, so it takes batches of any
    shape in graph mode (the per-token `ReferenceMoE` needs static shapes).
    Equals `tfdist.layers.MoE` (policy `all`, no jitter, no dropout) whenever
    its capacity admits every choice; it adds no auxiliary losses (compare
    with `aux_loss_coef=z_loss_coef=0`). Takes the MoE's config.
    """

    def __init__(self, num_experts, d_ff, top_k=2, activation="relu", **kwargs):
        for unused in ("capacity_factor", "eval_capacity_factor", "min_capacity", "group_size",
                       "aux_loss_coef", "z_loss_coef", "second_expert_policy",
                       "second_expert_threshold", "router_jitter", "dropout", "seed",
                       "hidden_axis"):
            kwargs.pop(unused, None)
        super().__init__(**kwargs)
        self.num_experts, self.d_ff, self.top_k = num_experts, d_ff, top_k
        self.activation = keras.activations.get(activation)

    def build(self, input_shape):
        add_expert_weights(self, input_shape)

    def call(self, inputs):
        x = tf.convert_to_tensor(inputs)
        probs = tf.nn.softmax(tf.einsum("...m,me->...e", x, self.router))
        gates, experts = tf.math.top_k(probs, k=self.top_k)
        if self.top_k == 2:
            gates = gates / (tf.reduce_sum(gates, axis=-1, keepdims=True) + 1e-9)
        mix = tf.reduce_sum(tf.one_hot(experts, self.num_experts) * gates[..., None], axis=-2)
        hidden = self.activation(tf.einsum("...m,emh->...eh", x, self.wi))
        return tf.einsum("...e,...eh,ehm->...m", mix, hidden, self.wo)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)
