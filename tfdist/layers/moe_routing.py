"""MoE routing as slot indices: which token fills each slot of each expert's buffer.

Every router here returns a `Routing` over one replica's `T = G * S` tokens
(`G` groups of `S`, GShard's local dispatch groups):

    slot_token [E, G, C]  int32, the token (a row of the flat `[T, M]` tokens)
                          in slot c of expert e's buffer for group g; T (no
                          token) where it is empty
    slot_gate  [E, G, C]  float32, that token's gate for expert e (0 if empty)
    stats                 `aux_loss`, `z_loss`, `dropped_fraction`, `load [E]`

The layer gathers the buffers `tokens[slot_token]` and scatter-adds
`slot_gate * expert_out` back onto the tokens: O(E*G*C*M) memory moves where
GShard's one-hot dispatch and combine einsums cost O(G*S*E*C*M) FLOPs.

Three routers:

- `token_choice`: each token picks its top-k experts (GShard; k from 1 to E).
  Every expert takes at most C tokens of a group: all first choices in token
  order, then all second choices, and so on; later ones are dropped.
- `token_choice` with `capacity=None` (dropless): nothing is dropped. The
  buffers are pooled over the replica's groups (G is 1) and sized per step
  by the busiest expert, agreed over the expert axis and rounded up to
  `bucket_size` (a bounded set of sizes, at most 1/8 padding), never above T.
- `expert_choice` (Zhou et al. 2022): each expert picks the C tokens of a
  group with the highest router probability for it. A token may be taken by
  several experts or none. It looks at the whole group: not causal.
"""

import collections

import keras
import tensorflow as tf

Routing = collections.namedtuple("Routing", "slot_token slot_gate stats")


def bucket_size(n):
    """`n` (a positive int32 tensor) rounded up to keep its 4 leading bits.

    Sizes 1..16, then 18, 20, ..., 32, then 36, 40, ...: at most 1/8 above
    `n`, and 8 sizes per doubling, so the shapes a dropless step can take
    (and the collectives' keys) stay few.
    """
    n = tf.maximum(tf.cast(n, tf.int32), 1)
    bits = tf.cast(tf.math.floor(tf.math.log(tf.cast(n, tf.float32)) / tf.math.log(2.0)),
                   tf.int32)
    step = tf.bitwise.left_shift(1, tf.maximum(bits - 3, 0))
    return (n + step - 1) // step * step


def token_means(real):
    """Means over a group's tokens and over groups, padding (`real` = 0) left out."""
    if real is None:
        return (lambda t, axis=None: tf.reduce_mean(t, axis=axis)), tf.reduce_mean
    in_group = tf.reduce_sum(real, axis=1)  # [G]

    def over_tokens(t, axis=None):  # t: [G, S] or [G, S, E]
        m = real if t.shape.rank == 2 else real[..., None]
        if axis == 1:
            return tf.math.divide_no_nan(tf.reduce_sum(t * m, axis=1), in_group[:, None])
        return tf.math.divide_no_nan(tf.reduce_sum(t * m, axis=axis), tf.reduce_sum(real))

    def over_groups(t):  # t: [G, E]; groups without real tokens left out
        used = tf.cast(in_group > 0, t.dtype)[:, None]
        return tf.math.divide_no_nan(tf.reduce_sum(t * used),
                                     tf.reduce_sum(used) * float(t.shape[-1]))

    return over_tokens, over_groups


def _slots(flat, values, size):
    """Scatters `values` to flat slot indices `flat` (index `size`: dropped)."""
    flat = tf.reshape(flat, [-1, 1])
    return tf.scatter_nd(flat, tf.reshape(values, [-1]), [size + 1])[:-1]


def _slot_arrays(experts, slots, kept, gates, capacity, num_experts, pooled):
    """`slot_token, slot_gate [E, G, C]` from each choice's expert, group and slot.

    `experts, slots, kept, gates`: `[G, S, k]`; `capacity` may be a tensor.
    `pooled` (dropless): one buffer per expert for every group (G = 1).
    """
    shape = tf.shape(experts)
    G, S, k = shape[0], shape[1], shape[2]
    tokens = G * S
    if pooled:
        num_groups, group = 1, tf.zeros_like(experts)
    else:
        num_groups, group = G, tf.range(G)[:, None, None] * tf.ones_like(experts)
    size = num_experts * num_groups * capacity
    flat = tf.where(kept, (experts * num_groups + group) * capacity + slots, size)
    token = tf.reshape(tf.range(tokens), [G, S, 1]) * tf.ones([1, 1, k], tf.int32)
    filled = _slots(flat, token + 1, size) - 1  # -1 where empty
    slot_token = tf.where(filled < 0, tokens, filled)
    slot_gate = _slots(flat, gates * tf.cast(kept, gates.dtype), size)
    out_shape = [num_experts, num_groups, capacity]
    return tf.reshape(slot_token, out_shape), tf.reshape(slot_gate, out_shape)


def token_choice(logits, top_k, capacity, second_expert_policy="all",
                 second_expert_threshold=0.2, training=False, seed=None, token_mask=None,
                 agree_capacity=None):
    """Each token picks its `top_k` experts (GShard; Switch for top-1).

    Args:
        logits: router logits `[G, S, E]` (float32).
        top_k: 1 to E. Gates: top-1 is the router probability; for k >= 2
            the k probabilities renormalised to sum to 1.
        capacity: C, tokens per expert and group; None: dropless.
        second_expert_policy: for top-2, which second choices are kept:
            `all`; `threshold` (gate_2 > threshold); `sampling` (in training,
            with probability gate_2 / threshold; in evaluation as `threshold`).
        second_expert_threshold: the threshold of the two policies above.
        training: whether the layer is training.
        seed: a `keras.random.SeedGenerator` for `sampling`.
        token_mask: optional `[G, S]`, 1 for real tokens, 0 for padding (the
            padded rows of a partial batch): padding goes to no expert, takes
            no capacity and is left out of every statistic.
        agree_capacity: dropless only, maps this replica's busiest expert's
            load to the load every replica exchanging buffers agrees on (a
            pmax over the expert axis).

    Returns:
        A `Routing`. `stats`: `aux_loss` (GShard load balancing, from first
        choices before capacity), `z_loss`, `dropped_fraction` (real tokens
        whose first choice was over capacity) and `load` (`[E]`, the fraction
        of tokens each expert takes as a kept first choice).
    """
    num_experts = logits.shape[-1]
    probs = tf.nn.softmax(logits, axis=-1)  # [G, S, E]
    gates, experts = tf.math.top_k(probs, k=top_k)  # [G, S, k], ties to the lower index
    real = None if token_mask is None else tf.cast(token_mask, probs.dtype)
    over_tokens, over_groups = token_means(real)

    first = tf.one_hot(experts[..., 0], num_experts, dtype=probs.dtype)  # [G, S, E]
    if real is not None:
        first *= real[..., None]
    # GShard's auxiliary loss: mean over groups and experts of
    # (fraction of tokens whose top-1 is e) * (mean router probability of e), times E^2.
    density = over_tokens(first, axis=1)  # [G, E]
    density_proxy = over_tokens(probs, axis=1)
    aux_loss = over_groups(density * density_proxy) * float(num_experts**2)
    z_loss = over_tokens(tf.square(tf.reduce_logsumexp(logits, axis=-1)))

    if top_k > 1:
        gates = gates / (tf.reduce_sum(gates, axis=-1, keepdims=True) + 1e-9)
    valid = tf.ones_like(gates, tf.bool) if real is None else \
        tf.tile(real[..., None] > 0, [1, 1, top_k])
    if top_k == 2 and second_expert_policy != "all":
        if second_expert_policy == "threshold" or not training:
            keep = gates[..., 1] > second_expert_threshold
        else:  # sampling
            uniform = keras.random.uniform(tf.shape(gates[..., 1]), seed=seed)
            keep = uniform < gates[..., 1] / max(second_expert_threshold, 1e-9)
        valid = tf.stack([valid[..., 0], valid[..., 1] & keep], axis=-1)

    choice = tf.one_hot(experts, num_experts, dtype=tf.int32) * \
        tf.cast(valid, tf.int32)[..., None]  # [G, S, k, E]
    G, S = tf.shape(logits)[0], tf.shape(logits)[1]
    dropless = capacity is None
    if dropless:  # one buffer per expert, choices in token order
        flat_choice = tf.reshape(choice, [-1, num_experts])  # [T*k, E]
        position = tf.cumsum(flat_choice, axis=0, exclusive=True)
        busiest = tf.reduce_max(tf.reduce_sum(flat_choice, axis=0))
        if agree_capacity is not None:
            busiest = agree_capacity(busiest)
        capacity = tf.minimum(bucket_size(busiest), G * S)
        slots = tf.reshape(tf.reduce_sum(position * flat_choice, -1), tf.shape(experts))
        kept = valid
    else:
        # Rank-major priority: every first choice of a group, then every second...
        by_rank = tf.reshape(tf.transpose(choice, [0, 2, 1, 3]), [G, -1, num_experts])
        position = tf.cumsum(by_rank, axis=1, exclusive=True) * by_rank
        slots = tf.transpose(tf.reshape(tf.reduce_sum(position, -1), [G, top_k, S]), [0, 2, 1])
        kept = valid & (slots < capacity)
    slot_token, slot_gate = _slot_arrays(experts, slots, kept, gates, capacity, num_experts,
                                         pooled=dropless)

    kept_first = tf.cast(kept[..., 0], probs.dtype)  # [G, S]
    first_kept = first * kept_first[..., None]
    if real is None:
        load = tf.reduce_mean(first_kept, axis=[0, 1])
        dropped = 1.0 - tf.reduce_mean(kept_first)
    else:
        load = tf.reduce_sum(first_kept, axis=[0, 1]) / tf.maximum(tf.reduce_sum(real), 1.0)
        dropped = tf.math.divide_no_nan(tf.reduce_sum(real - kept_first), tf.reduce_sum(real))
    stats = dict(aux_loss=aux_loss, z_loss=z_loss, dropped_fraction=dropped, load=load)
    return Routing(slot_token, slot_gate, stats)


def one_hot(routing, group_size):
    """GShard's one-hot `dispatch, combine [G, S, E, C]` of a `Routing` with capacity.

    `dispatch[g, s, e, c]` is 1 where token s of group g fills slot c of
    expert e, `combine` holds its gate there; an empty slot (token T) is in no
    group's range and so all zeros. For `dispatch="one_hot"`, whose einsums
    move the tokens at O(G*S*E*C*M) FLOPs; the routing is the same.
    """
    G = tf.shape(routing.slot_token)[1]
    group_start = tf.reshape(tf.range(G) * group_size, [1, G, 1])
    in_group = routing.slot_token - group_start  # [E, G, C]; empty: >= S
    dispatch = tf.transpose(tf.one_hot(in_group, group_size, dtype=routing.slot_gate.dtype),
                            [1, 3, 0, 2])  # [E, G, C, S] -> [G, S, E, C]
    gates = tf.transpose(routing.slot_gate, [1, 0, 2])[:, None]  # [G, 1, E, C]
    return dispatch, dispatch * gates


def expert_choice(logits, capacity, token_mask=None):
    """Each expert takes the `capacity` tokens of a group it scores highest (Zhou et al.).

    Gates are the router probabilities (softmax over experts) of the chosen
    pairs; ties go to the earlier token. No load-balancing loss is needed
    (`aux_loss` is 0); `dropped_fraction` is the fraction of real tokens no
    expert took and `load` the fraction of real tokens each expert took.
    Padding (`token_mask` 0) is never taken; an expert with fewer real
    tokens than slots leaves the rest empty.
    """
    num_experts = logits.shape[-1]
    probs = tf.nn.softmax(logits, axis=-1)  # [G, S, E]
    G, S = tf.shape(logits)[0], tf.shape(logits)[1]
    real = tf.ones([G, S], probs.dtype) if token_mask is None else \
        tf.cast(token_mask, probs.dtype)
    scores = tf.where(real[..., None] > 0, probs, -1.0)
    _, picked = tf.math.top_k(tf.transpose(scores, [2, 0, 1]), k=capacity)  # [E, G, C]
    token = picked + tf.range(G)[None, :, None] * S  # rows of the flat tokens
    taken = tf.gather(tf.reshape(real, [-1]), token)  # 0 for padding
    expert = tf.range(num_experts)[:, None, None] * tf.ones_like(token)
    slot_gate = tf.gather_nd(tf.reshape(probs, [-1, num_experts]),
                             tf.stack([token, expert], axis=-1)) * taken
    slot_token = tf.where(taken > 0, token, G * S)

    over_tokens, _ = token_means(None if token_mask is None else real)
    z_loss = over_tokens(tf.square(tf.reduce_logsumexp(logits, axis=-1)))
    tokens = tf.maximum(tf.reduce_sum(real), 1.0)
    times_taken = tf.math.unsorted_segment_sum(tf.reshape(taken, [-1]),
                                               tf.reshape(token, [-1]), G * S)
    untaken = tf.reduce_sum(real * tf.reshape(tf.cast(times_taken == 0, real.dtype), [G, S]))
    stats = dict(aux_loss=tf.zeros([], probs.dtype), z_loss=z_loss,
                 dropped_fraction=untaken / tokens,
                 load=tf.reduce_sum(taken, axis=[1, 2]) / tokens)
    return Routing(slot_token, slot_gate, stats)
