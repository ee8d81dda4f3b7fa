"""Gradient clipping on the *global* gradient, as one device clips it.

Keras clips gradients per replica, before the data-parallel all-reduce
(`BaseOptimizer._backend_apply_gradients`), so under any multi-replica
strategy `clipnorm` and `global_clipnorm` clip each replica's partial
gradient by its own norm: training silently differs from one device. Under a
tfdist strategy the optimizer's clipping is deferred
(`tfdist.internal.gradient_seam`) and applied here, after each gradient
is reduced, with norms over the global tensors: a sharded weight's squared
norm is the sum over its distinct shards (one all-reduce for all weights).

Keras's order of precedence holds: `clipnorm`, else `global_clipnorm`, else
`clipvalue`; the formulas are Keras's (`tf.clip_by_norm`,
`clip_by_global_norm`, `clip`), also for the sparse gradient of a Keras
`Embedding` (rows clipped and counted as Keras counts them).
"""

import dataclasses
from typing import Callable, List, Optional, Sequence

import tensorflow as tf


@dataclasses.dataclass(frozen=True)
class Clipping:
    """An optimizer's clipping options (None or <= 0: off)."""

    clipnorm: Optional[float] = None
    global_clipnorm: Optional[float] = None
    clipvalue: Optional[float] = None

    @classmethod
    def of(cls, optimizer) -> "Clipping":
        return cls(optimizer.clipnorm, optimizer.global_clipnorm, optimizer.clipvalue)

    @property
    def active(self) -> bool:
        return any(v is not None and v > 0 for v in dataclasses.astuple(self))


def clip_global(clipping: Clipping, grads: Sequence, sharded: Sequence[bool],
                owners: Sequence[int], sum_over_replicas: Callable) -> List:
    """One replica's reduced gradients, clipped as one device clips the global gradient.

    Args:
        clipping: the options.
        grads: this replica's reduced gradients (a shard for a sharded weight).
        sharded: whether each gradient is a shard.
        owners: how many replicas hold the same shard (1 for replicated ones).
        sum_over_replicas: sums a float32 vector over every replica (a collective
            all replicas call in the same order).
    """
    if clipping.clipnorm is not None and clipping.clipnorm > 0:
        squares = _global_squares(grads, sharded, owners, sum_over_replicas)
        return [tf.clip_by_norm(g, clipping.clipnorm) if isinstance(g, tf.IndexedSlices)
                else _clip_by_norm(g, s, clipping.clipnorm) for g, s in zip(grads, squares)]
    if clipping.global_clipnorm is not None and clipping.global_clipnorm > 0:
        squares = _global_squares(grads, sharded, owners, sum_over_replicas)
        norm = tf.sqrt(tf.add_n(squares))
        clip = tf.cast(clipping.global_clipnorm, norm.dtype)
        scale = clip * tf.minimum(1.0 / norm, 1.0 / clip)
        scale = scale + (norm - norm)  # NaN for a non-finite norm, as Keras
        # As Keras: `IndexedSlices * scale` is dense (duplicate rows summed).
        return [g * tf.cast(scale, g.dtype) for g in grads]
    if clipping.clipvalue is not None and clipping.clipvalue > 0:
        v = clipping.clipvalue
        return [tf.clip_by_value(g, -v, v) for g in grads]
    return list(grads)


def _global_squares(grads, sharded, owners, sum_over_replicas):
    """Each gradient's squared L2 norm over its global tensor (float32).

    An `IndexedSlices` (a replicated weight's, complete on every replica) counts
    its rows as Keras does: the sum of their squares, duplicates included.
    """
    local = [tf.reduce_sum(tf.square(tf.cast(g.values if isinstance(g, tf.IndexedSlices) else g,
                                             tf.float32))) for g in grads]
    shard_positions = [k for k, s in enumerate(sharded) if s]
    if not shard_positions:
        return local
    # Every shard is held by `owners[k]` replicas: the sum over all replicas of
    # its squared norm / owners is the sum over the distinct shards.
    parts = tf.stack([local[k] / owners[k] for k in shard_positions])
    summed = tf.unstack(sum_over_replicas(parts), num=len(shard_positions))
    out = list(local)
    for k, s in zip(shard_positions, summed):
        out[k] = s
    return out


def _clip_by_norm(g, l2sum, clip_norm):
    """`tf.clip_by_norm(g, clip_norm)` with the global `l2sum` of the tensor `g` is part of."""
    l2sum = tf.cast(l2sum, g.dtype)
    positive = l2sum > 0
    l2norm = tf.where(positive, tf.sqrt(tf.where(positive, l2sum, tf.ones_like(l2sum))), l2sum)
    clip = tf.cast(clip_norm, g.dtype)
    return g * clip / tf.maximum(l2norm, clip)
