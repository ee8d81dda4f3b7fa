"""Collective instance keys for run-time shapes: one small shape id per step.

TensorFlow's V2 collectives keep the shape of an instance `(group_key,
instance_key)` from its first execution for the life of the process, and never
free the record. A traced step whose collectives get fixed keys can therefore
run on one shape only: a partial last batch, a second length bucket or a
varying expert buffer fails with "Shape mismatch in the collective instance".

`ShapeIds` gives every step a *shape id*: the index, in order of first
appearance, of the run-time shapes of the step's inputs among those this traced
step has seen. A collective whose input shape is not static at trace time takes
instance key `base + id`, where `base` is its trace-time key and the backend
reserves `max_shapes` keys after each base; a collective of static shape keeps
`base`. So

- every execution of an instance has one shape (the step's inputs determine
  the shapes of its collectives), also inside a `steps_per_execution` loop,
  whose iterations each draw their own id;
- the resolver's records stay bounded: at most `max_shapes` per collective;
- every replica and process agrees on the id whatever happened before: the id
  comes from one table, on the host of the mesh's first device, read and
  extended under a `tf.CriticalSection` in one op. No per-device state can
  drift, so a failed step leaves nothing to repair.

A step that meets more than `max_shapes` distinct input shapes fails with an
error naming the limit instead of growing the records without bound.

A collective whose shape changes while the step's inputs keep theirs (a
dropless MoE's expert buffers, sized by the busiest expert each step) asks for
`own_shape_id` instead: the id of its own run-time shape among those it has
met, one table lookup per execution, bounded the same way (the MoE rounds its
buffer sizes to a few buckets).
"""

import itertools
import threading

import tensorflow as tf

DEFAULT_MAX_SHAPES = 64


def host_of(device: str) -> str:
    """The CPU of `device`'s task (where a table and its mutex live)."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()


class ShapeIds:
    """The table from (traced step, input shapes) to a shape id, on one host.

    Args:
        device: the host device (a CPU) that holds the table.
        max_shapes: distinct input shapes one traced step may meet.
    """

    _trace_ids = itertools.count(1)
    _lock = threading.Lock()

    def __init__(self, device: str, max_shapes: int = DEFAULT_MAX_SHAPES):
        if int(max_shapes) < 1:
            raise ValueError(f"max_shapes must be a positive integer; received {max_shapes!r}.")
        self.device = device
        self.max_shapes = int(max_shapes)
        self._own_tables = {}  # device -> table of `own_shape_id`
        with tf.init_scope(), tf.device(device):
            self._table = tf.lookup.experimental.MutableHashTable(
                tf.string, tf.int64, default_value=-1, name="tfdist_shape_ids")
            self._section = tf.CriticalSection(name="tfdist_shape_ids")

    @classmethod
    def new_trace(cls) -> int:
        """A fresh id for one traced step (its shape ids are numbered apart)."""
        with cls._lock:
            return next(cls._trace_ids)

    def shape_id(self, trace: int, tensors):
        """The int32 shape id of `tensors`' run-time shapes within trace `trace`.

        Args:
            trace: from `new_trace()`, once per traced step.
            tensors: the step's input tensors (every replica's), in a fixed order.
        """
        return self._id(f"{trace}:", tensors)

    def own_shape_id(self, instance_key: int, x, device: str):
        """The int32 id of `x`'s run-time shape among those collective `instance_key` met.

        For a collective whose shape changes while the step's inputs keep
        theirs (`shape_varies`): one lookup per execution, in a table of the
        calling device (`device`). Not the shared table: its lookup depends on
        `x`, so on the peers' earlier collectives, and TF chains the ops on one
        table in trace order across replicas (replica 0's whole step is traced
        before replica 1's), a cycle that hung. Every device of the group runs
        the same instances with the same shapes in the same order, so each
        device's table numbers them alike. Past `max_shapes` shapes the id
        stays at the last one and TF fails the collective ("Shape mismatch in
        the collective instance"): no assert, which TF would chain across
        replicas too.
        """
        with self._lock:
            if device not in self._own_tables:
                with tf.init_scope(), tf.device(device):
                    self._own_tables[device] = tf.lookup.experimental.MutableHashTable(
                        tf.string, tf.int64, default_value=-1, name="tfdist_own_shape_ids")
            table = self._own_tables[device]
        with tf.device(device):
            dims = tf.strings.reduce_join(tf.strings.as_string(tf.shape(x, out_type=tf.int64)),
                                          separator=",")
            key = tf.strings.join([f"c{instance_key}:", dims])
            count_key = tf.constant(f"c{instance_key}:#")

            def add():
                count = tf.maximum(table.lookup(count_key), 0)
                added = table.insert(tf.stack([key, count_key]), tf.stack([count, count + 1]))
                with tf.control_dependencies([added]):
                    return tf.minimum(count, self.max_shapes - 1)

            found = table.lookup(key)
            return tf.cast(tf.cond(found >= 0, lambda: found, add), tf.int32)

    def _id(self, prefix, tensors):
        """Index, in order of first appearance under `prefix`, of `tensors`' shapes."""
        shapes = [tf.shape(t, out_type=tf.int64) for t in tensors]
        with tf.device(self.device):
            dims = tf.concat([tf.reshape(tf.cast(s, tf.int64), [-1]) for s in shapes]
                             + [tf.constant([len(shapes)], tf.int64)], axis=0)
            key = tf.strings.join([prefix,
                                   tf.strings.reduce_join(tf.strings.as_string(dims), separator=",")])
            count_key = tf.constant(f"{prefix}#")
            limit = self.max_shapes
            table = self._table

            def lookup_or_add():
                found = table.lookup(key)

                def add():
                    count = tf.maximum(table.lookup(count_key), 0)
                    check = tf.debugging.Assert(count < limit, [
                        f"tfdist: a traced step met more than {limit} distinct input shapes "
                        f"(its collectives keep one record per shape). Bucket the varying "
                        f"dimensions (e.g. tf.data's bucket_by_sequence_length) or create "
                        f"the strategy with a larger max_shapes. This shape:", key])
                    with tf.control_dependencies([check]):
                        added = table.insert(tf.stack([key, count_key]), tf.stack([count, count + 1]))
                    with tf.control_dependencies([added]):
                        return tf.identity(count)

                return tf.cond(found >= 0, lambda: found, add)

            return tf.cast(self._section.execute(lookup_or_add), tf.int32)

    def size(self):
        """How many (trace, shape) entries the table holds (for tests and benchmarks)."""
        return self._table.size()
