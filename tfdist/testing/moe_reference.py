"""A single-device MoE written differently: a per-token loop over chosen experts.

No dispatch or combine tensors, no cumsum, no slot indices, no top-k op: for
each group it finds each token's choices by repeated argmax, walks the tokens
in order keeping a running count of tokens per expert, admits a token's first
choice while its expert has room, then walks them again for second choices
(and so on), and adds `gate * FFN_e(token)` for each admitted choice. Expert
choice ranks each expert's tokens by pairwise comparison instead. Dropless is
the same loop with no limit. Shared experts: a plain matmul FFN added. Same
weights and gates as `tfdist.layers.MoE` (policy `all`, no jitter, no dropout).
"""

import keras
import tensorflow as tf

from tfdist.layers.moe import expert_capacity


def add_expert_weights(layer, input_shape):
    """The MoE's weights, in its order: router `[M, E]`, wi `[E, M, H]`, wo `[E, H, M]`,
    then with shared experts `shared_wi [M, Hs]`, `shared_wo [Hs, M]`."""
    d_model = int(input_shape[-1])
    E, H = layer.num_experts, layer.d_ff
    layer.router = layer.add_weight(name="router", shape=(d_model, E))
    layer.wi = layer.add_weight(name="wi", shape=(E, d_model, H))
    layer.wo = layer.add_weight(name="wo", shape=(E, H, d_model))
    if layer.shared_d_ff:
        layer.shared_wi = layer.add_weight(name="shared_wi", shape=(d_model, layer.shared_d_ff))
        layer.shared_wo = layer.add_weight(name="shared_wo", shape=(layer.shared_d_ff, d_model))


def _shared(layer, x):
    """The shared experts' FFN on `x [..., M]` (zero without them)."""
    if not layer.shared_d_ff:
        return tf.zeros_like(x)
    return tf.matmul(layer.activation(tf.matmul(x, layer.shared_wi)), layer.shared_wo)


def _top_choices(probs, top_k):
    """Each row's `top_k` experts by repeated argmax (earlier index on ties), and gates."""
    E = probs.shape[-1]
    choices, taken = [], tf.zeros_like(probs)
    for _ in range(top_k):
        pick = tf.argmax(probs - 2.0 * taken, axis=-1, output_type=tf.int32)
        choices.append(pick)
        taken += tf.one_hot(pick, E)
    picked = [tf.gather(probs, c, batch_dims=1) for c in choices]
    if top_k == 1:
        return choices, picked
    total = tf.add_n(picked) + 1e-9
    return choices, [p / total for p in picked]


@keras.saving.register_keras_serializable(package="tfdist_testing")
class ReferenceMoE(keras.layers.Layer):
    """The per-token-loop twin of `tfdist.layers.MoE` (takes the same config)."""

    def __init__(self, num_experts, d_ff, top_k=2, capacity_factor=1.25,
                 eval_capacity_factor=2.0, min_capacity=4, group_size=1024,
                 aux_loss_coef=1e-2, z_loss_coef=0.0, activation="relu",
                 routing="token_choice", dropless=False, shared_d_ff=0, **kwargs):
        for unsupported in ("second_expert_policy", "second_expert_threshold",
                            "router_jitter", "dropout", "seed", "hidden_axis", "causal",
                            "dispatch"):
            kwargs.pop(unsupported, None)
        super().__init__(**kwargs)
        self.num_experts, self.d_ff, self.top_k = num_experts, d_ff, top_k
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity, self.group_size = min_capacity, group_size
        self.aux_loss_coef, self.z_loss_coef = aux_loss_coef, z_loss_coef
        self.activation = keras.activations.get(activation)
        self.routing, self.dropless, self.shared_d_ff = routing, dropless, shared_d_ff

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
        outputs, aux_terms, z_terms = [], [], []
        for g in range(num_tokens // S):
            group = tokens[g * S:(g + 1) * S]
            logits = tf.matmul(group, self.router)  # [S, E]
            probs = tf.nn.softmax(logits)
            z_terms.append(tf.reduce_mean(tf.square(tf.reduce_logsumexp(logits, axis=-1))))
            if self.routing == "expert_choice":
                capacity = min(S, expert_capacity(S, E, 1, factor, self.min_capacity))
                outputs.append(self._expert_choice(group, probs, capacity))
                continue
            capacity = expert_capacity(S, E, self.top_k, factor, self.min_capacity)
            if self.dropless:
                capacity = S * self.top_k  # never reached
            choices, gates = _top_choices(probs, self.top_k)
            aux_terms.append(tf.reduce_mean(
                tf.reduce_mean(tf.one_hot(choices[0], E), 0) * tf.reduce_mean(probs, 0)) * E * E)
            count = tf.zeros([E])
            out = [tf.zeros([d_model]) for _ in range(S)]
            for choice, gate in zip(choices, gates):  # all first choices before any second
                for s in range(S):
                    e = choice[s]
                    admitted = tf.cast(tf.gather(count, e) < capacity, tf.float32)
                    count += tf.one_hot(e, E) * admitted
                    out[s] = out[s] + admitted * gate[s] * self._expert(e, group[s])
            outputs.append(tf.stack(out))
        z = tf.add_n(z_terms) / len(z_terms)
        aux = tf.add_n(aux_terms) / len(aux_terms) if aux_terms else 0.0
        self.add_loss(self.aux_loss_coef * aux + self.z_loss_coef * z)
        y = tf.concat(outputs, axis=0) + _shared(self, tokens)
        return tf.reshape(y, tf.shape(x))

    def _expert_choice(self, group, probs, capacity):
        """Expert e takes the tokens whose score for e fewer than `capacity` others beat."""
        S = group.shape[0]
        out = [tf.zeros([group.shape[-1]]) for _ in range(S)]
        for e in range(self.num_experts):
            score = probs[:, e]  # [S]
            for s in range(S):
                beaten_by = tf.reduce_sum(tf.cast(score > score[s], tf.int32))
                if s:  # ties: the earlier token first
                    beaten_by += tf.reduce_sum(tf.cast(tf.equal(score[:s], score[s]), tf.int32))
                taken = tf.cast(beaten_by < capacity, tf.float32)
                out[s] = out[s] + taken * score[s] * self._expert(tf.constant(e), group[s])
        return tf.stack(out)

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

    def __init__(self, num_experts, d_ff, top_k=2, activation="relu", shared_d_ff=0,
                 **kwargs):
        for unused in ("capacity_factor", "eval_capacity_factor", "min_capacity", "group_size",
                       "aux_loss_coef", "z_loss_coef", "second_expert_policy",
                       "second_expert_threshold", "router_jitter", "dropout", "seed",
                       "hidden_axis", "routing", "dropless", "causal", "dispatch"):
            kwargs.pop(unused, None)
        super().__init__(**kwargs)
        self.num_experts, self.d_ff, self.top_k = num_experts, d_ff, top_k
        self.activation = keras.activations.get(activation)
        self.shared_d_ff = shared_d_ff

    def build(self, input_shape):
        add_expert_weights(self, input_shape)

    def call(self, inputs):
        x = tf.convert_to_tensor(inputs)
        probs = tf.nn.softmax(tf.einsum("...m,me->...e", x, self.router))
        gates, experts = tf.math.top_k(probs, k=self.top_k)
        if self.top_k > 1:
            gates = gates / (tf.reduce_sum(gates, axis=-1, keepdims=True) + 1e-9)
        mix = tf.reduce_sum(tf.one_hot(experts, self.num_experts) * gates[..., None], axis=-2)
        hidden = self.activation(tf.einsum("...m,emh->...eh", x, self.wi))
        return tf.einsum("...e,...eh,ehm->...m", mix, hidden, self.wo) + _shared(self, x)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)
