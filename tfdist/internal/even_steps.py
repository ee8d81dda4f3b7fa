"""Keras steps on uneven replicas, evened out before the replicas run.

Private TF API used: `tensorflow.python.distribute.distribute_utils`'s
`select_replica` and `regroup` (one replica's part of a distributed structure,
and per-replica structures back into `PerReplica` values), as
MirroredStrategy itself uses them.

Why: see `tfdist.batch_rows`. A tfdist strategy's `_call_for_each_replica`
passes Keras's train, test and predict steps (`tfdist.internal.keras_steps`)
through `even_keras_step`, which pads every replica's rows to the step's
largest, makes each replica's `Rows` (its row mask) current while its step runs
(Keras's losses and metrics then count only real rows: `tfdist.internal.keras_rows`),
and cuts predictions back to the real rows. Other functions given to
`strategy.run` are left alone. Checked by `tests/strategies/test_partial_batches.py`.
"""

from typing import Sequence

import tensorflow as tf
from tensorflow.python.distribute import distribute_utils

from tfdist import batch_rows
from tfdist.internal import keras_rows
from tfdist.internal.keras_steps import keras_step_kind, keras_step_model


def even_keras_step(fn, args, kwargs, devices: Sequence[str]):
    """`(fn, args)` for `_call_for_each_replica`, evened out if `fn` is a Keras step.

    Args:
        fn, args, kwargs: as given to `_call_for_each_replica`.
        devices: the replica devices, every replica of the mesh (a single
            controller: in one process, or driving the workers).
    """
    kind = keras_step_kind(fn)
    if kind is None or len(args) != 1 or kwargs or len(devices) == 1:
        return fn, args
    parts = [distribute_utils.select_replica(i, args[0]) for i in range(len(devices))]
    firsts = [batch_rows.first_batched(p) for p in parts]
    if any(t is None for t in firsts):
        return fn, args
    static = [t.shape[0] for t in firsts]
    if None not in static and len(set(static)) == 1:
        return fn, args
    counts = []
    for device, t in zip(devices, firsts):
        with tf.device(device):
            counts.append(tf.shape(t, out_type=tf.int32)[0])
    with tf.device(devices[0]):
        everyone = tf.stack(counts)
        n = tf.reduce_max(everyone)
        total = tf.maximum(tf.cast(tf.reduce_sum(everyone), tf.float32), 1.0)
    even = []
    for device, part, count in zip(devices, parts, counts):
        with tf.device(device):
            mask = tf.sequence_mask(count, n, dtype=tf.float32)
            even.append((batch_rows.pad_rows(part, n), mask, count))
    if kind != "predict":
        keras_rows.track_real_rows(keras_step_model(fn))

    def even_step(data, mask, count):
        with batch_rows.replica_rows(batch_rows.Rows(mask, count, n, total)):
            out = fn(data)
        return batch_rows.real_rows(out, count) if kind == "predict" else out

    return even_step, tuple(distribute_utils.regroup(even))
