"""Partial batches on a mesh: every replica holds the same rows, only real rows count.

A batch whose rows do not divide over the replicas (the last batch of a
dataset, or any batch of a size the replica count does not divide) reaches
the replicas unevenly: some hold one row fewer, some none. The sharded
layers' collectives need every replica of a group to hold the same rows, and
Keras normalises each replica's loss by its *own* rows and then by the replica
count, so uneven replicas train differently from one device even under
MirroredStrategy. A tfdist strategy therefore evens out every Keras step:

- each replica's rows are padded with zeros to the step's largest replica, `n`,
  and the replica's `Rows` (a mask of its real rows) is current while it runs;
- Keras's losses and compiled metrics count only real rows, and a mean loss
  is divided by the real rows of *all* replicas (`Rows.total`) rather than by
  the local rows (`tfdist.internal.keras_rows`), so the replicas' losses add
  up to one device's mean over the batch;
- `predict` returns each replica's real rows only: all rows, in order;
- layers that pool over tokens (the MoE's routing and capacity) read
  `current()` and leave the padding out.

A replica with no real rows computes on `n` padded rows of weight 0: nothing
hangs and nothing divides by zero (`Rows.total` is at least one row).
"""

import contextlib
import dataclasses
import threading
from typing import Optional

import tensorflow as tf

_local = threading.local()  # MirroredStrategy runs each replica in its own thread


@dataclasses.dataclass(frozen=True)
class Rows:
    """The rows of the current replica in an evened-out step.

    Attributes:
        mask: `[n]` float32, 1 for this replica's real rows, then 0 for padding.
        count: int32 scalar, this replica's real rows (the mask's leading ones).
        padded: int32 scalar `n`, the rows every replica holds.
        total: float32 scalar, the real rows of the whole step over every replica.
    """

    mask: tf.Tensor
    count: tf.Tensor
    padded: tf.Tensor
    total: tf.Tensor


def current() -> Optional[Rows]:
    """The current replica's `Rows` inside an evened-out Keras step, else None."""
    return getattr(_local, "rows", None)


@contextlib.contextmanager
def replica_rows(rows: Rows):
    """Makes `rows` the current replica's rows (in this replica's thread)."""
    previous = current()
    _local.rows = rows
    try:
        yield
    finally:
        _local.rows = previous


def first_batched(structure):
    """The first tensor of `structure` that has a dimension 0 (its rows), or None."""
    for t in tf.nest.flatten(structure):
        if isinstance(t, tf.Tensor) and t.shape.rank:
            return t
    return None


def pad_rows(structure, n):
    """Every tensor of `structure` padded with zeros on dimension 0 to `n` rows."""
    def pad(t):
        if not isinstance(t, tf.Tensor) or not t.shape.rank:
            return t
        extra = n - tf.shape(t, out_type=tf.int32)[0]
        return tf.pad(t, [[0, extra]] + [[0, 0]] * (t.shape.rank - 1))

    return tf.nest.map_structure(pad, structure)


def real_rows(structure, count):
    """Every tensor of `structure` cut to its first `count` rows (predictions)."""
    def cut(t):
        if not isinstance(t, tf.Tensor) or not t.shape.rank:
            return t
        return t[:count]

    return tf.nest.map_structure(cut, structure)
