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

Where each process runs its own replica (HorovodStrategy, MultiWorkerStrategy)
no process sees the others' rows, so `counted_keras_step` asks them inside the
step: each replica exchanges its row count (`gather_counts`, one small
collective per step) and then pads, if its strategy needs even replicas, and
runs as above. Under MultiWorkerStrategy (`wrap_mirrored_steps`) replicas
share no collective but the gradient all-reduce, so nothing is padded: only the
losses, metrics and loss tracker count the global rows.
"""

from typing import Sequence

import tensorflow as tf
from tensorflow.python.distribute import distribute_utils

from tfdist import batch_rows
from tfdist.internal import keras_rows
from tfdist.internal.keras_steps import keras_step_kind, keras_step_model


def _step_kind(fn, args, kwargs, pad: bool):
    """The Keras step kind of `fn` if its rows are to be counted (one data argument), else None.

    A predict step is left alone unless its replicas are padded: it has no loss
    to normalise, and its outputs are gathered as they are.
    """
    kind = keras_step_kind(fn)
    if kind is None or len(args) != 1 or kwargs or (kind == "predict" and not pad):
        return None
    if kind != "predict":
        keras_rows.track_real_rows(keras_step_model(fn))
    return kind


def _real_rows_total(everyone):
    """The step's real rows over every replica (float32, at least one row)."""
    return tf.maximum(tf.cast(tf.reduce_sum(everyone), tf.float32), 1.0)


def _replica_part(data, count, n, pad: bool):
    """`(data, mask, padded rows)` of one replica: padded to `n` rows, or as it is."""
    if pad:
        return batch_rows.pad_rows(data, n), tf.sequence_mask(count, n, dtype=tf.float32), n
    return data, tf.ones([count], tf.float32), count


def _run_on_rows(fn, kind, data, rows: batch_rows.Rows):
    """`fn(data)` with `rows` current; a predict step's outputs cut to the real rows."""
    with batch_rows.replica_rows(rows):
        out = fn(data)
    return batch_rows.real_rows(out, rows.count) if kind == "predict" else out


def even_keras_step(fn, args, kwargs, devices: Sequence[str], pad: bool = True):
    """`(fn, args)` for `_call_for_each_replica`, evened out if `fn` is a Keras step.

    Args:
        fn, args, kwargs: as given to `_call_for_each_replica`.
        devices: the replica devices, every replica of the mesh (a single
            controller: in one process, or driving the workers).
        pad: pad every replica to the step's largest (for layers that exchange
            activations between replicas); without it the replicas keep their
            rows, only the losses, metrics and loss tracker count the real rows
            of all replicas, and predict steps are left alone.
    """
    kind = _step_kind(fn, args, kwargs, pad) if len(devices) > 1 else None
    if kind is None:
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
        total = _real_rows_total(everyone)
    even = []
    for device, part, count in zip(devices, parts, counts):
        with tf.device(device):
            even.append((*_replica_part(part, count, n, pad), count))

    def even_step(data, mask, padded, count):
        return _run_on_rows(fn, kind, data, batch_rows.Rows(mask, count, padded, total))

    return even_step, tuple(distribute_utils.regroup(even))


def counted_keras_step(fn, args, kwargs, gather_counts, pad: bool):
    """`(fn, args)` for a strategy whose replicas learn each other's rows in the step.

    Args:
        fn, args, kwargs: as given to `_call_for_each_replica`.
        gather_counts: `count -> [replicas]` int32, every replica's row count
            (a collective every replica of the step calls in the same order).
        pad: pad every replica to the step's largest (for strategies whose
            layers exchange activations between replicas); predictions are
            then cut back. Without it, predict steps are left alone.
    """
    kind = _step_kind(fn, args, kwargs, pad)
    if kind is None:
        return fn, args

    def counted_step(data):
        first = batch_rows.first_batched(data)
        if first is None:
            return fn(data)
        count = tf.shape(first, out_type=tf.int32)[0]
        everyone = gather_counts(count)
        n = tf.reduce_max(everyone) if pad else count
        data, mask, padded = _replica_part(data, count, n, pad)
        return _run_on_rows(fn, kind, data,
                            batch_rows.Rows(mask, count, padded, _real_rows_total(everyone)))

    return counted_step, args


def wrap_mirrored_steps(extended) -> None:
    """Makes a `MultiWorkerMirroredStrategy`'s Keras train/test steps count global rows.

    Private TF API: wraps the instance's `_call_for_each_replica` (its
    `MirroredExtended` hook that runs a function on every local replica); the
    counts are exchanged with the replica context's `all_gather`.
    """
    call = extended._call_for_each_replica

    def gather_counts(count):
        ctx = tf.distribute.get_replica_context()
        return ctx.all_gather(count[tf.newaxis], axis=0)

    def call_for_each_replica(fn, args, kwargs):
        fn, args = counted_keras_step(fn, args, kwargs, gather_counts, pad=False)
        return call(fn, args, kwargs)

    extended._call_for_each_replica = call_for_each_replica
