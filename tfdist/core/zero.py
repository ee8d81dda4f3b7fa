"""ZeRO-1/2: a weight stored split over the batch axis and the whole copy replicas read.

The weight (with its optimizer slots and gradient) is split over the batch
axis on one dimension; `KeptWhole` is the whole copy every replica reads,
refreshed after each optimizer step. With ZeRO-1 the replicas hand the
strategy their whole gradient, summed over the owners of the `LayoutMap`'s
own layout and then cut to each device's shard (`own_slice`); with ZeRO-2
it is reduce-scattered in the backward pass.
"""

import dataclasses
from typing import Optional

import tensorflow as tf

from tfdist.mesh import TensorLayout


@dataclasses.dataclass(frozen=True)
class KeptWhole:
    """ZeRO-1/2's whole copy of a weight stored split over the batch axis.

    The weight (and so its optimizer slots and gradient) is stored split over
    `axis` on dimension `dim` (`layout`); `copy` holds it gathered over `axis`
    on every device, laid out like the `LayoutMap` lays it out (`base`: None
    or a layout over other axes), and is what replicas read. tfdist refreshes
    it after every optimizer step and every assignment of the weight.
    """

    copy: tf.Variable
    base: Optional[TensorLayout]
    axis: str
    dim: int
    whole_gradient: bool = False
    """ZeRO-1: replicas hand the strategy the weight's whole local gradient, which
    `ShardRouting.reduce_gradients` all-reduces (fused with the replicated weights')
    and then slices; ZeRO-2 (False): reduce-scattered in the backward pass."""


def whole_gradient(var) -> bool:
    """Whether `var` is a ZeRO-1 weight, whose replicas hand over their whole gradient."""
    kept = getattr(var, "_tfdist_kept", None)
    return kept is not None and kept.whole_gradient


def reduction_groups(var, everyone):
    """The device groups a sharded variable's gradient is summed over.

    A shard's owners; for a ZeRO-1 weight, whose replicas hand over their whole
    gradients, the owners of the `LayoutMap`'s own layout (all devices when it
    is replicated): the sum is then cut to each device's shard (`own_slice`).
    """
    if not whole_gradient(var):
        return var.layout.shard_owner_groups()
    base = var._tfdist_kept.base
    return base.shard_owner_groups() if base is not None else [everyone]


def own_slice(reduced, var, index):
    """A ZeRO-1 weight's reduced whole gradient cut to device `index`'s shard; else as is.

    A sparse one (`IndexedSlices` rows, a Keras `Embedding`) stays sparse, as
    Keras's optimizers need it: split rows keep the entries of this device's
    rows, renumbered; split columns keep this device's columns of each entry.
    """
    if not whole_gradient(var):
        return reduced
    dim = var._tfdist_kept.dim  # split over the batch axis only: global = whole-local
    own = var.layout.shard_slices(index)[dim]
    if not isinstance(reduced, tf.IndexedSlices):
        return reduced[(slice(None),) * dim + (own,)]
    dense_shape = tf.constant(var.layout.local_shape, reduced.dense_shape.dtype)
    if dim > 0:
        return tf.IndexedSlices(reduced.values[(slice(None),) * dim + (own,)],
                                reduced.indices, dense_shape)
    local = reduced.indices - tf.cast(own.start, reduced.indices.dtype)
    held = (local >= 0) & (local < own.stop - own.start)
    return tf.IndexedSlices(tf.boolean_mask(reduced.values, held), tf.boolean_mask(local, held),
                            dense_shape)
