"""Ulysses attention: all-to-all from a split sequence to split heads and back.

DeepSpeed-Ulysses (Jacobs et al. 2023): every device holds `length / P`
tokens of every head; an all-to-all gives each device `heads / P` heads of
the whole sequence, attention runs locally (the blockwise kernel, one chunk
pair at a time), and a second all-to-all returns the output to the sequence
split. Four all-to-alls of `b L h / P` values each per device (queries,
keys, values, output; grouped queries shrink keys and values), against the
ring's `2 (P - 1)` blocks of keys and values.

    q [B, L/P, H, D] -> all_to_all -> [B, L, H/P, D]   (tokens in device order)
    attention per chunk pair, causal by global chunk ids
    out [B, L, H/P, D] -> all_to_all -> [B, L/P, H, D]

Query heads must divide by `P`. Key/value heads that do not are repeated
(each `r = P / gcd(kv_heads, P)` times, keeping the query groups) so that
they do.
"""

import math
from typing import Optional

import tensorflow as tf

from tfdist import collectives
from tfdist.sequence.ring import attend, check_shapes
from tfdist.sequence.split import SequenceSplit


def ulysses_attention(q, k, v, axis: Optional[str], *, causal: bool = False, key_mask=None,
                      balanced: bool = False, scale: Optional[float] = None,
                      block: Optional[int] = None, window: Optional[int] = None):
    """Dot-product attention over a sequence split along `axis`, by head all-to-alls.

    Args and returns as `tfdist.sequence.ring_attention`.

    Raises:
        ValueError: the query heads do not divide by the axis's devices.
    """
    check_shapes(q, k, v, key_mask, causal)
    if window is not None and not causal:
        raise ValueError(f"A sliding window (window={window}) needs causal=True.")
    parts = collectives.axis_size(axis)
    heads, kv_heads = int(q.shape[2]), int(k.shape[2])
    if heads % parts:
        raise ValueError(
            f"Ulysses attention splits the {heads} query heads over the {parts} devices of mesh "
            f"axis {axis!r}: the heads must be a multiple of {parts} (or use ring attention).")
    repeat = parts // math.gcd(kv_heads, parts)
    if repeat > 1:
        k, v = (tf.repeat(x, repeat, axis=2) for x in (k, v))
    if parts > 1:
        q, k, v = (collectives.all_to_all(x, axis, split_dim=2, concat_dim=1) for x in (q, k, v))
        if key_mask is not None:
            key_mask = collectives.all_gather(
                tf.stop_gradient(tf.cast(key_mask, tf.float32)), axis, dim=1)
    if causal:  # the gathered tokens, device after device: each device's chunks in order
        split = SequenceSplit(int(q.shape[1]), parts, balanced)
        q_ids = k_ids = sum((split.chunks(j) for j in range(parts)), ())
    else:  # one chunk per device's tokens
        q_ids = k_ids = tuple(range(parts))
    out = attend(q, k, v, key_mask, axis=None, scale=scale, causal=causal, q_ids=q_ids,
                 k_ids_of=lambda j: k_ids, index=0, parts=1, block=block, window=window)
    if parts > 1:
        out = collectives.all_to_all(out, axis, split_dim=1, concat_dim=2)
    return out
