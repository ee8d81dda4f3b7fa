"""GShard's top-1/top-2 gating as GShard writes it: a reference for the MoE's router.

`tfdist.layers.moe_routing.token_choice` computes slot indices with one top-k
and a rank-major cumulative sum; this computes GShard's one-hot dispatch and
combine tensors with argmax choices, one mask per rank and its own capacity
arithmetic (Lepikhin et al. 2020, Algorithm 1), sharing no code with it. Tests
compare `moe_routing.one_hot(token_choice(...))` with it on random logits.
"""

import keras
import tensorflow as tf


def _token_means(real):
    """Means over a group's tokens `[G, S(, E)]` and over groups, padding left out."""
    if real is None:
        return (lambda t, axis=None: tf.reduce_mean(t, axis=axis)), tf.reduce_mean
    in_group = tf.reduce_sum(real, axis=1)  # [G]

    def over_tokens(t, axis=None):
        m = real if t.shape.rank == 2 else real[..., None]
        if axis == 1:
            return tf.math.divide_no_nan(tf.reduce_sum(t * m, axis=1), in_group[:, None])
        return tf.math.divide_no_nan(tf.reduce_sum(t * m, axis=axis), tf.reduce_sum(real))

    def over_groups(t):  # [G, E]: groups with no real token left out
        used = tf.cast(in_group > 0, t.dtype)[:, None]
        return tf.math.divide_no_nan(tf.reduce_sum(t * used),
                                     tf.reduce_sum(used) * float(t.shape[-1]))

    return over_tokens, over_groups


def gshard_top_k_gating(
    logits,
    top_k,
    capacity,
    second_expert_policy="all",
    second_expert_threshold=0.2,
    training=False,
    seed=None,
    token_mask=None,
):
    """GShard's top-1/top-2 gating with capacity, written as GShard writes it.

    A reference for `tfdist.layers.moe_routing` that shares no code with it:
    one-hot masks, cumulative sums for the slots, argmax choices.

    Args:
        logits: router logits `[G, S, E]` (float32).
        top_k: 1 (Switch) or 2 (GShard).
        capacity: C, tokens per expert per group.
        second_expert_policy: for top-2, which second choices are kept:
            `all`; `threshold` (gate_2 > threshold); `sampling` (in training,
            with probability gate_2 / threshold; in evaluation as `threshold`).
        second_expert_threshold: the threshold of the two policies above.
        training: whether the layer is training.
        seed: a `keras.random.SeedGenerator` for `sampling`.
        token_mask: optional `[G, S]`, 1 for real tokens, 0 for padding (the
            padded rows of a partial batch, `tfdist.batch_rows`): padding goes
            to no expert, takes no capacity and is left out of every statistic.

    Returns:
        `(dispatch, combine, stats)`: `dispatch [G, S, E, C]` is 1 where a token
        goes to slot c of expert e; `combine [G, S, E, C]` holds its gate there;
        `stats` has `aux_loss` (GShard load balancing), `z_loss`,
        `dropped_fraction` (tokens whose top-1 choice was over capacity) and
        `load` (`[E]`, fraction of tokens each expert takes as top-1).
    """
    num_experts = logits.shape[-1]
    probs = tf.nn.softmax(logits, axis=-1)  # [G, S, E]
    index_1 = tf.argmax(probs, axis=-1)  # [G, S]
    mask_1 = tf.one_hot(index_1, num_experts, dtype=probs.dtype)  # [G, S, E]
    gate_1 = tf.reduce_sum(probs * mask_1, axis=-1)  # [G, S]
    real = None if token_mask is None else tf.cast(token_mask, probs.dtype)  # [G, S]
    if real is not None:
        mask_1 *= real[..., None]
    mean_over_tokens, mean_over_groups = _token_means(real)

    # GShard's auxiliary loss: mean over groups and experts of
    # (fraction of tokens whose top-1 is e) * (mean router probability of e), times E^2.
    density = mean_over_tokens(mask_1, axis=1)  # [G, E]
    density_proxy = mean_over_tokens(probs, axis=1)  # [G, E]
    aux_loss = mean_over_groups(density * density_proxy) * float(num_experts**2)
    z_loss = mean_over_tokens(tf.square(tf.reduce_logsumexp(logits, axis=-1)))

    if top_k == 2:
        probs_2 = probs * (1.0 - mask_1)
        index_2 = tf.argmax(probs_2, axis=-1)
        mask_2 = tf.one_hot(index_2, num_experts, dtype=probs.dtype)
        gate_2 = tf.reduce_sum(probs_2 * mask_2, axis=-1)
        if token_mask is not None:
            mask_2 *= real[..., None]
        denom = gate_1 + gate_2 + 1e-9
        gate_1, gate_2 = gate_1 / denom, gate_2 / denom
        if second_expert_policy == "threshold" or (
            second_expert_policy == "sampling" and not training
        ):
            mask_2 *= tf.cast(gate_2 > second_expert_threshold, probs.dtype)[..., None]
        elif second_expert_policy == "sampling":
            uniform = keras.random.uniform(tf.shape(gate_2), seed=seed)
            keep = uniform < gate_2 / max(second_expert_threshold, 1e-9)
            mask_2 *= tf.cast(keep, probs.dtype)[..., None]

    # Slot of each token in its expert: top-1 choices first, in token order.
    position_1 = tf.cumsum(mask_1, axis=1, exclusive=True) * mask_1  # [G, S, E]
    mask_1 *= tf.cast(position_1 < capacity, probs.dtype)
    kept_1 = tf.reduce_sum(mask_1, axis=-1)  # [G, S]
    slot_1 = tf.cast(tf.reduce_sum(position_1 * mask_1, axis=-1), tf.int32)  # [G, S]
    dispatch = mask_1[..., None] * tf.one_hot(slot_1, capacity, dtype=probs.dtype)[:, :, None, :]
    combine = (gate_1 * kept_1)[..., None, None] * dispatch  # [G, S, E, C]
    if token_mask is None:
        load = tf.reduce_mean(mask_1, axis=[0, 1])  # [E]
        dropped = 1.0 - tf.reduce_mean(kept_1)
    else:
        tokens = tf.maximum(tf.reduce_sum(real), 1.0)
        load = tf.reduce_sum(mask_1, axis=[0, 1]) / tokens
        dropped = tf.math.divide_no_nan(tf.reduce_sum(real - kept_1), tf.reduce_sum(real))

    if top_k == 2:
        taken_1 = tf.reduce_sum(mask_1, axis=1, keepdims=True)  # [G, 1, E]
        position_2 = (tf.cumsum(mask_2, axis=1, exclusive=True) + taken_1) * mask_2
        mask_2 *= tf.cast(position_2 < capacity, probs.dtype)
        kept_2 = tf.reduce_sum(mask_2, axis=-1)
        slot_2 = tf.cast(tf.reduce_sum(position_2 * mask_2, axis=-1), tf.int32)
        dispatch_2 = mask_2[..., None] * tf.one_hot(slot_2, capacity, dtype=probs.dtype)[:, :, None, :]
        dispatch += dispatch_2
        combine += (gate_2 * kept_2)[..., None, None] * dispatch_2

    stats = dict(aux_loss=aux_loss, z_loss=z_loss, dropped_fraction=dropped, load=load)
    return dispatch, combine, stats
