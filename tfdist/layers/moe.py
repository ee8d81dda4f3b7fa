"""Mixture of experts (GShard, Switch, expert choice, dropless), sharded by the layout rules.

Dimension cheat-sheet (as in Mesh-TF's moe.py):

    B  batch (per replica)          L  length
    M  d_model                      H  d_ff (expert hidden size)
    T  tokens = B * L               S  group size (tokens per dispatch group)
    G  groups = T / S               E  experts
    C  expert capacity per group    A  size of the mesh axis the experts
                                       (or d_ff) are split over

Routing (`tfdist.layers.moe_routing`) happens within each group of S
consecutive tokens (GShard's local dispatch groups). Token choice: each token
picks its top-k experts, every expert takes at most C tokens of a group (first
choices first, in token order, then second choices, ...), and tokens over
capacity pass through with zero output from that expert (the model's residual
carries them):

    C = max(min_capacity, min(S, ceil(top_k * S * capacity_factor / E)))

Expert choice: each expert takes its C = ceil(S * capacity_factor / E)
highest-scoring tokens of a group. Dropless: token choice with buffers sized
each step by the busiest expert, nothing dropped; where every expert is on the
device (no `experts:A`), each expert's FFN runs on exactly its own rows instead.

Dispatch is by index: each expert's buffer `[E, G, C, M]` is gathered from the
tokens and the outputs scatter-added back with their gates, O(E*G*C*M) moves
(GShard's one-hot einsums, `dispatch="one_hot"`, cost O(G*S*E*C*M) FLOPs).

Expert parallelism (`experts:A`): each device holds E/A experts; tokens go to
their experts and back with two all-to-alls over A. Expert hidden split
(`d_ff:A`): each device holds every expert's H/A slice; the batch is gathered
over A and the partial outputs reduce-scattered back. Shared experts (an
always-on FFN of `shared_d_ff` units, DeepSeekMoE / Qwen-MoE) split their
hidden units like the experts' (`d_ff:A`) or are replicated.
"""

import math

import keras
import tensorflow as tf

from tfdist import batch_rows, collectives, sequence
from tfdist.layers import moe_routing
from tfdist.layers.weights import (
    add_sharded_weight,
    check_mesh,
    check_positive_int,
    disable_jit_on_multi_device_mesh,
    sharded_mesh_axis,
)

SECOND_EXPERT_POLICIES = ("all", "sampling", "threshold")
ROUTINGS = ("token_choice", "expert_choice")
DISPATCHES = ("index", "one_hot")


def expert_capacity(group_size, num_experts, top_k, capacity_factor, min_capacity):
    """Tokens each expert takes from one group of `group_size` tokens."""
    wanted = math.ceil(top_k * group_size * capacity_factor / num_experts)
    return max(min_capacity, min(group_size, wanted))


class MaxExpertLoad(keras.metrics.Metric):
    """The busiest expert's load: its fraction of the tokens (as top-1) times E.

    `result()` is 1.0 when the load is balanced, E when one expert takes
    every token; `per_expert()` returns the `[E]` fractions, averaged over
    the updates.
    """

    def __init__(self, num_experts, name="max_expert_load", **kwargs):
        super().__init__(name=name, **kwargs)
        self.num_experts = num_experts
        self.total = self.add_variable(shape=(num_experts,), initializer="zeros", name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def update_state(self, load):
        self.total.assign_add(tf.cast(load, self.dtype))
        self.count.assign_add(tf.constant(1.0, self.dtype))

    def per_expert(self):
        return self.total / tf.maximum(self.count, 1.0)

    def result(self):
        return tf.reduce_max(self.per_expert()) * float(self.num_experts)

    def get_config(self):
        return {"num_experts": self.num_experts, "name": self.name}


@keras.saving.register_keras_serializable(package="tfdist")
class MoE(keras.layers.Layer):
    """A mixture-of-experts feed-forward layer (GShard, Switch, expert choice, dropless).

    Args:
        num_experts: E.
        d_ff: H, each expert's hidden size.
        top_k: experts per token, 1 (Switch) to E; 2 is GShard's. Gates: the
            router probability for top-1, else the k probabilities
            renormalised to sum to 1. Token choice only.
        routing: `token_choice` (each token picks its top_k experts) or
            `expert_choice` (each expert picks its top C tokens of a group,
            Zhou et al. 2022; not causal, so not for a decoder).
        capacity_factor: capacity factor in training (Mesh-TF: 1.25). Expert
            choice: C = ceil(S * capacity_factor / E) tokens per expert.
        eval_capacity_factor: capacity factor in evaluation (Mesh-TF: 2.0).
        min_capacity: the least capacity per expert and group.
        dropless: token choice that drops no token: the experts' buffers are
            sized each step by the busiest expert (agreed over the expert
            axis, rounded up to one of a bounded set of sizes, at most the
            replica's token count); the capacity arguments are unused. Where
            the experts are not split over devices, no buffer is padded:
            each expert computes on exactly the tokens routed to it.
        shared_d_ff: hidden size of an always-on FFN added to the routed
            output (DeepSeekMoE / Qwen-MoE shared experts); 0 for none.
        second_expert_policy: `all`, `sampling` or `threshold` (top-2 only).
        second_expert_threshold: threshold of the two policies above.
        group_size: S, tokens per dispatch group; in training it must divide
            the tokens each replica holds (batch * length); in inference a
            smaller group (the largest that divides the tokens) is used
            where it does not.
        aux_loss_coef: weight of GShard's load-balancing loss (Mesh-TF: 1e-2;
            expert choice has none).
        z_loss_coef: weight of the router z-loss (ST-MoE).
        router_jitter: in training, multiply router inputs by noise drawn
            uniformly from [1 - jitter, 1 + jitter] (Switch).
        activation: expert activation.
        dropout: dropout rate on the expert hidden activations.
        seed: seed for jitter, dropout and sampling.
        hidden_axis: the logical axis of the experts' (and shared experts')
            hidden dimension ("d_ff", or None to never split it: for a
            layout that splits `experts` and `d_ff` over the same mesh axis,
            as a transformer whose dense FFNs split `d_ff` does).
        causal: the layer is in a causal model (a decoder), where a token's
            output must not depend on later tokens: expert choice is refused.
        dispatch: `index` (gather the tokens into the experts' buffers and
            scatter-add them back) or `one_hot` (GShard's dispatch and
            combine einsums over the same routing; not dropless).

    Input shape: `[batch, length, d_model]` or `[batch, d_model]`.
    Output shape: the same.

    Weights: `router [d_model, E]` (replicated), `wi [E, d_model, d_ff]` and
    `wo [E, d_ff, d_model]` with logical axes `experts`, `d_model`, `d_ff`;
    with shared experts, `shared_wi [d_model, shared_d_ff]` and
    `shared_wo [shared_d_ff, d_model]` (`d_model`, `d_ff`).

    Example:

    ```python
    strategy = MeshStrategy("data:2;model:2", "batch:data;experts:model")
    with strategy.scope():
        moe = MoE(num_experts=8, d_ff=1024, top_k=2, group_size=256)
        y = x + moe(x)   # each device holds 4 of the 8 experts
    ```
    """

    def __init__(
        self,
        num_experts,
        d_ff,
        top_k=2,
        capacity_factor=1.25,
        eval_capacity_factor=2.0,
        min_capacity=4,
        second_expert_policy="all",
        second_expert_threshold=0.2,
        group_size=1024,
        aux_loss_coef=1e-2,
        z_loss_coef=0.0,
        router_jitter=0.0,
        activation="relu",
        dropout=0.0,
        seed=None,
        hidden_axis="d_ff",
        routing="token_choice",
        dropless=False,
        shared_d_ff=0,
        causal=False,
        dispatch="index",
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.num_experts = check_positive_int("num_experts", num_experts)
        self.d_ff = check_positive_int("d_ff", d_ff)
        self.group_size = check_positive_int("group_size", group_size)
        self.min_capacity = check_positive_int("min_capacity", min_capacity)
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
            raise ValueError(
                f"`top_k` must be an integer from 1 to num_experts={num_experts}. "
                f"Received: top_k={top_k!r}"
            )
        for name, value in (("capacity_factor", capacity_factor),
                            ("eval_capacity_factor", eval_capacity_factor)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"`{name}` must be positive. Received: {name}={value!r}")
        if second_expert_policy not in SECOND_EXPERT_POLICIES:
            raise ValueError(
                f"`second_expert_policy` must be one of {list(SECOND_EXPERT_POLICIES)}. "
                f"Received: second_expert_policy={second_expert_policy!r}"
            )
        if second_expert_policy != "all" and top_k > 2:
            raise ValueError(
                f"`second_expert_policy={second_expert_policy!r}` decides second choices of "
                f"top-2 routing; use 'all' with top_k={top_k}."
            )
        for name, value in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef),
                            ("router_jitter", router_jitter),
                            ("second_expert_threshold", second_expert_threshold)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"`{name}` must be >= 0. Received: {name}={value!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"`dropout` must be in [0, 1). Received: dropout={dropout!r}")
        if router_jitter >= 1:
            raise ValueError(f"`router_jitter` must be < 1. Received: router_jitter={router_jitter!r}")
        if hidden_axis not in ("d_ff", None):
            raise ValueError(f"`hidden_axis` must be 'd_ff' or None. Received: {hidden_axis!r}")
        if routing not in ROUTINGS:
            raise ValueError(f"`routing` must be one of {list(ROUTINGS)}. Received: "
                             f"routing={routing!r}")
        if routing == "expert_choice" and causal:
            raise ValueError(
                f"Layer {self.name!r}: routing='expert_choice' lets each expert pick among "
                f"all tokens of a group, so a token's output depends on later tokens; a "
                f"causal (decoder) MoE must use routing='token_choice'."
            )
        if routing == "expert_choice" and (top_k != 2 or second_expert_policy != "all"):
            # top_k's default is 2: anything else was asked for and would be ignored.
            raise ValueError(
                f"`top_k` and `second_expert_policy` are token-choice arguments; with "
                f"routing='expert_choice' the capacity factor sets the tokens per expert. "
                f"Received: top_k={top_k!r}, second_expert_policy={second_expert_policy!r}"
            )
        if dropless and routing != "token_choice":
            raise ValueError(f"`dropless=True` is token-choice routing without capacity; "
                             f"received routing={routing!r}.")
        if not isinstance(shared_d_ff, int) or isinstance(shared_d_ff, bool) or shared_d_ff < 0:
            raise ValueError(f"`shared_d_ff` must be an integer >= 0. Received: "
                             f"shared_d_ff={shared_d_ff!r}")
        if dispatch not in DISPATCHES:
            raise ValueError(f"`dispatch` must be one of {list(DISPATCHES)}. Received: "
                             f"dispatch={dispatch!r}")
        if dispatch == "one_hot" and dropless:
            raise ValueError(
                f"dispatch='one_hot' is GShard's dispatch into buffers of a fixed capacity; "
                f"received dropless={dropless!r}. Use dispatch='index'."
            )
        self.top_k = top_k
        self.capacity_factor = float(capacity_factor)
        self.eval_capacity_factor = float(eval_capacity_factor)
        self.second_expert_policy = second_expert_policy
        self.second_expert_threshold = float(second_expert_threshold)
        self.aux_loss_coef = float(aux_loss_coef)
        self.z_loss_coef = float(z_loss_coef)
        self.router_jitter = float(router_jitter)
        self.activation = keras.activations.get(activation)
        self.dropout = float(dropout)
        self.seed = seed
        self.hidden_axis = hidden_axis
        self.routing = routing
        self.dropless = bool(dropless)
        self.shared_d_ff = shared_d_ff
        self.causal = bool(causal)
        self.dispatch = dispatch
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.weight_layouts = {}
        disable_jit_on_multi_device_mesh(self)
        if self.dropless:
            self.supports_jit = False  # buffer sizes are known only at run time
        self.aux_loss_metric = keras.metrics.Mean(name=f"{self.name}_aux_loss")
        self.z_loss_metric = keras.metrics.Mean(name=f"{self.name}_z_loss")
        self.dropped_metric = keras.metrics.Mean(name=f"{self.name}_dropped")
        self.load_metric = MaxExpertLoad(num_experts, name=f"{self.name}_max_load")

    def build(self, input_shape):
        d_model = int(input_shape[-1])
        E, H = self.num_experts, self.d_ff
        fan_in = keras.initializers.VarianceScaling(1.0, "fan_in")
        self.router = add_sharded_weight(self, "router", (d_model, E), ("d_model", None),
                                         initializer="glorot_uniform")
        self.wi = add_sharded_weight(self, "wi", (E, d_model, H),
                                     ("experts", "d_model", self.hidden_axis), initializer=fan_in)
        self.wo = add_sharded_weight(self, "wo", (E, H, d_model),
                                     ("experts", self.hidden_axis, "d_model"), initializer=fan_in)
        if self.shared_d_ff:
            self.shared_wi = add_sharded_weight(self, "shared_wi", (d_model, self.shared_d_ff),
                                                ("d_model", self.hidden_axis), initializer=fan_in)
            self.shared_wo = add_sharded_weight(self, "shared_wo", (self.shared_d_ff, d_model),
                                                (self.hidden_axis, "d_model"), initializer=fan_in)
        layout = self.weight_layouts["wi"]
        self._expert_axis = sharded_mesh_axis(layout, 0)
        self._ff_axis = sharded_mesh_axis(layout, 2)
        if sharded_mesh_axis(layout, 1) is not None:
            raise ValueError(
                f"Layer {self.name!r}: expert weights {layout} are split over "
                f"d_model; MoE splits experts or d_ff."
            )
        if self._expert_axis and self._ff_axis:
            raise ValueError(
                f"Layer {self.name!r}: expert weights {layout} are split over both "
                f"experts and d_ff; use one of the rules 'experts:...' or 'd_ff:...'."
            )

    def call(self, inputs, training=False):
        check_mesh(self)
        x = tf.convert_to_tensor(inputs)
        shape = tf.shape(x)
        d_model = x.shape[-1]
        tokens = tf.reshape(x, [-1, d_model])  # [T, M]
        if self._ff_axis is not None:
            tokens = collectives.all_gather(tokens, self._ff_axis, dim=0)  # [T*A, M]
        num_tokens = tokens.shape[0]
        S = self.group_size
        if num_tokens is not None and num_tokens % S and not training:
            # Inference (e.g. a decoding step of batch * beam tokens): the
            # largest group size that divides the tokens, at most group_size.
            S = math.gcd(num_tokens, S)
        self._check_sequence_groups(x, S)
        if num_tokens is not None and num_tokens % S:
            raise ValueError(
                f"Layer {self.name!r}: group_size={S} must divide the {num_tokens} "
                f"tokens (batch * length) each replica routes; use a batch whose "
                f"per-replica token count is a multiple of {S}."
            )
        if num_tokens is None:
            # Batches of several shapes (length buckets): the reshape into groups below
            # fails at run time if S does not divide the tokens. No assert op here: TF
            # orders stateful ops without resources (asserts) one after another across
            # the replicas of a step, and the replicas' asserts of two MoE layers would
            # then wait on each other's all-to-alls (a deadlock).
            num_tokens = tf.shape(tokens)[0]
        groups = tf.reshape(tokens, [-1, S, d_model])  # [G, S, M]
        token_mask = self._token_mask(x)
        if token_mask is not None:
            if self._ff_axis is not None:
                token_mask = collectives.all_gather(token_mask, self._ff_axis, dim=0)
            token_mask = tf.reshape(token_mask, [-1, S])  # [G, S]

        router_in = groups
        if training and self.router_jitter > 0:
            router_in = groups * keras.random.uniform(
                tf.shape(groups), 1.0 - self.router_jitter, 1.0 + self.router_jitter,
                seed=self.seed_generator)
        logits = tf.einsum("gsm,me->gse", tf.cast(router_in, "float32"),
                           tf.cast(self.router, "float32"))  # [G, S, E]
        if self.dispatch == "one_hot":
            y, stats = self._one_hot_experts(groups, logits, S, training, token_mask)
        else:
            routing = self._route(logits, S, training, token_mask)
            y, stats = self._experts(tokens, routing, training), routing.stats
        y = tf.reshape(y, [num_tokens, d_model])
        if self.shared_d_ff:
            y += self._shared_experts(tokens, training)
        if self._ff_axis is not None:
            y = collectives.reduce_scatter(y, self._ff_axis, dim=0)  # partial over H -> [T, M]

        aux_coef = self.aux_loss_coef if self.routing == "token_choice" else 0.0
        self.add_loss(aux_coef * stats["aux_loss"] + self.z_loss_coef * stats["z_loss"])
        self.aux_loss_metric.update_state(stats["aux_loss"])
        self.z_loss_metric.update_state(stats["z_loss"])
        self.dropped_metric.update_state(stats["dropped_fraction"])
        self.load_metric.update_state(stats["load"])
        return tf.reshape(y, shape)

    def _capacity(self, S, training):
        factor = self.capacity_factor if training else self.eval_capacity_factor
        if self.routing == "expert_choice":
            return min(S, expert_capacity(S, self.num_experts, 1, factor, self.min_capacity))
        return expert_capacity(S, self.num_experts, self.top_k, factor, self.min_capacity)

    def _route(self, logits, S, training, token_mask):
        if self.routing == "expert_choice":
            return moe_routing.expert_choice(logits, self._capacity(S, training), token_mask)

        def agree(busiest):  # every device of the expert axis sizes its buffers alike
            return tf.cast(collectives.pmax(tf.cast(busiest, tf.float32), self._expert_axis),
                           tf.int32)

        return moe_routing.token_choice(
            logits, self.top_k, None if self.dropless else self._capacity(S, training),
            self.second_expert_policy, self.second_expert_threshold, training,
            self.seed_generator, token_mask, agree_capacity=agree)

    def _experts(self, tokens, routing, training):
        """The routed output `[T, M]`: buffers gathered by index, outputs scatter-added back."""
        if self.dropless and self._expert_axis is None:
            return self._ragged_experts(tokens, routing, training)
        num_tokens = tf.shape(tokens)[0]
        # An empty slot (token T) computes on the last token's row and is left out of
        # the sum (segment -1): no zero row is appended to the tokens and sliced off the
        # output (a copy of [T, M] each way, forward and backward: 2% of the layer).
        # Its gradient is zero: the sum never reads it.
        filled = routing.slot_token < num_tokens
        expert_in = tf.gather(tokens, tf.minimum(routing.slot_token, num_tokens - 1))
        expert_out = self._expert_ffn(expert_in, training)  # [E, G, C, M]
        weighted = expert_out * tf.cast(routing.slot_gate, expert_out.dtype)[..., None]
        segment = tf.where(filled, routing.slot_token, -1)
        return tf.math.unsorted_segment_sum(tf.reshape(weighted, [-1, tokens.shape[-1]]),
                                            tf.reshape(segment, [-1]), num_tokens)

    def _ragged_experts(self, tokens, routing, training):
        """Dropless with every expert here: each expert's FFN on exactly its own rows.

        The pooled buffers `[E, 1, C]` are filled from slot 0 on, so their
        filled slots, expert by expert, are the routed rows sorted by expert:
        no padding row is computed (the padded buffers cost every expert the
        busiest one's load, rounded up to a bucket).
        """
        num_tokens = tf.shape(tokens)[0]
        filled = routing.slot_token < num_tokens  # [E, 1, C]
        token = tf.boolean_mask(routing.slot_token, filled)  # [N], expert by expert
        gate = tf.boolean_mask(routing.slot_gate, filled)
        loads = tf.reduce_sum(tf.cast(filled, tf.int32), axis=[1, 2])  # [E]
        rows = tf.split(tf.gather(tokens, token), loads, num=self.num_experts)
        outputs = []
        for x, wi, wo in zip(rows, tf.unstack(self.wi), tf.unstack(self.wo)):
            hidden = self.activation(tf.matmul(x, wi))
            if training and self.dropout > 0:
                hidden = keras.random.dropout(hidden, self.dropout, seed=self.seed_generator)
            outputs.append(tf.matmul(hidden, wo))
        weighted = tf.concat(outputs, axis=0) * tf.cast(gate, tokens.dtype)[:, None]
        return tf.math.unsorted_segment_sum(weighted, token, num_tokens)

    def _one_hot_experts(self, groups, logits, S, training, token_mask):
        """GShard's formulation: one-hot dispatch and combine einsums, same routing."""
        routing = self._route(logits, S, training, token_mask)
        dispatch, combine = moe_routing.one_hot(routing, S)  # [G, S, E, C]
        dispatch = tf.cast(dispatch, groups.dtype)
        combine = tf.cast(combine, groups.dtype)
        expert_in = tf.einsum("gsec,gsm->egcm", dispatch, groups)  # [E, G, C, M]
        expert_out = self._expert_ffn(expert_in, training)
        return tf.einsum("gsec,egcm->gsm", combine, expert_out), routing.stats  # [G, S, M]

    def _expert_ffn(self, expert_in, training):
        """Every expert's FFN on its buffers `[E, G, C, M]`, expert-parallel over A."""
        if self._expert_axis is not None:
            # [E, G, C, M] -> [E/A, G*A, C, M]: each device gets its experts' tokens.
            expert_in = collectives.all_to_all(expert_in, self._expert_axis, split_dim=0,
                                               concat_dim=1, shape_varies=self.dropless)
        buffers = tf.shape(expert_in)
        rows = tf.reshape(expert_in, [buffers[0], -1, expert_in.shape[-1]])  # [E', G'*C, M]
        hidden = self.activation(tf.matmul(rows, self.wi))
        if training and self.dropout > 0:
            hidden = keras.random.dropout(hidden, self.dropout, seed=self.seed_generator)
        expert_out = tf.reshape(tf.matmul(hidden, self.wo), buffers)  # [E', G', C, M]
        if self._expert_axis is not None:
            # [E/A, G*A, C, M] -> [E, G, C, M]: outputs go back to their tokens.
            expert_out = collectives.all_to_all(expert_out, self._expert_axis, split_dim=1,
                                                concat_dim=0, shape_varies=self.dropless)
        return expert_out

    def _shared_experts(self, tokens, training):
        """The always-on FFN on every token: partial sums over H/A when `d_ff` is split.

        Its hidden units are split like the experts' (`hidden_axis`), so the
        tokens are the ones already gathered over that axis and the partial
        sums go back with the routed output's reduce-scatter.
        """
        hidden = self.activation(tf.matmul(tokens, self.shared_wi))
        if training and self.dropout > 0:
            hidden = keras.random.dropout(hidden, self.dropout, seed=self.seed_generator)
        return tf.matmul(hidden, self.shared_wo)

    def _check_sequence_groups(self, x, S):
        """Over a sequence split (`length` on a mesh axis of P devices, zig-zag: each
        device holds 2 chunks of length / 2P tokens of every row), a group must lie
        inside one chunk for the groups, and with them capacity and the losses, to be
        one device's."""
        axis = sequence.length_axis()
        if axis is None or x.shape.rank != 3 or x.shape[1] is None:
            return
        chunk = x.shape[1] // 2
        if chunk % S:
            parts = collectives.axis_size(axis)
            raise ValueError(
                f"Layer {self.name!r}: group_size={S} does not divide the {chunk} tokens of "
                f"a zig-zag chunk (length {2 * chunk * parts} over the {parts} devices of mesh "
                f"axis {axis!r}: 2 x {parts} chunks), so its groups would not be one "
                f"device's; use a group_size that divides {chunk}.")

    @staticmethod
    def _token_mask(x):
        """`[T]` 1/0 for real/padded tokens in a partial batch's step, else None.

        The rows are the step's (`tfdist.batch_rows`) when `x` has one row per
        step row, as in a Transformer's training and evaluation; inputs of
        other rows (a decoder's batch * beam) are taken as all real.
        """
        rows = batch_rows.current()
        if rows is None:
            return None
        per_row = tf.reduce_prod(tf.shape(x)[1:-1])
        return tf.cond(
            tf.equal(tf.shape(x)[0], rows.padded),
            lambda: tf.repeat(rows.mask, per_row),
            lambda: tf.ones([tf.reduce_prod(tf.shape(x)[:-1])], rows.mask.dtype))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def get_config(self):
        config = super().get_config()
        config.update(
            num_experts=self.num_experts,
            d_ff=self.d_ff,
            top_k=self.top_k,
            capacity_factor=self.capacity_factor,
            eval_capacity_factor=self.eval_capacity_factor,
            min_capacity=self.min_capacity,
            second_expert_policy=self.second_expert_policy,
            second_expert_threshold=self.second_expert_threshold,
            group_size=self.group_size,
            aux_loss_coef=self.aux_loss_coef,
            z_loss_coef=self.z_loss_coef,
            router_jitter=self.router_jitter,
            activation=keras.activations.serialize(self.activation),
            dropout=self.dropout,
            seed=self.seed,
            hidden_axis=self.hidden_axis,
            routing=self.routing,
            dropless=self.dropless,
            shared_d_ff=self.shared_d_ff,
            causal=self.causal,
            dispatch=self.dispatch,
        )
        return config
