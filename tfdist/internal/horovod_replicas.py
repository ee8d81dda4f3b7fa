"""HorovodExtended: one tf.distribute replica per Horovod process.

Private TF APIs used here (and only here): `MirroredExtended` and its hooks
`_reduce_to`, `_batch_reduce_to`, `_create_variable`,
`_experimental_distribute_dataset`, `_num_replicas_in_sync`, `_call_for_each_replica`;
`values.Mirrored`;
through `ShardRouting` and
`ShardedVariable` those of `shard_routing`.

`horovod.tensorflow.keras` targets Keras 2 optimizers and breaks on TF >= 2.16
(horovod#4290), so instead of wrapping the optimizer we make Horovod the
strategy's cross-replica engine: a MirroredExtended over this process's one
device whose replica count is `hvd.size()`, whose reductions are Horovod
all-reduces (gradients routed by variable through `tfdist.comm.HorovodBackend`'s
grouped all-reduce, see `ShardRouting`), whose variables start from rank 0's
initial values (shards: see below), and whose datasets give each rank its contiguous slice of
every global batch (as MirroredStrategy splits a batch over its devices), so
an unmodified Keras 3 `fit` trains exactly like one process on the same
global batches. Metric variables are on-read synchronised: read outside a
step (Keras's epoch and `evaluate` logs) they are summed over ranks.

Keras's `predict` concatenates what `strategy.run` returns on this process
only; for its step function (recognised by `tfdist.internal.keras_steps`)
the outputs are all-gathered in rank order, so every rank's `predict` returns
all rows in order.

With `HorovodStrategy(batch_shares=...)` (pure data parallelism only) every
rank reads the whole global batch and its step cuts its own contiguous share,
by bounds held in a variable (`set_batch_bounds`): read in the step, so a
change of shares takes effect on every rank at the same step; uneven shares
train exactly as equal ones (the rows are counted below, nothing is padded).

A partial batch reaches the ranks unevenly (a rank may get no row): Keras's
train and test steps exchange the ranks' row counts (one Horovod all-gather)
and count the real rows of every rank (`tfdist.internal.even_steps.counted_keras_step`);
when the mesh splits a weight over ranks (so layers exchange activations),
every rank is also padded to the largest, predictions included.

With a mesh, rank `r` is mesh device `r`: a sharded weight is a
`HorovodShardedVariable` holding only this rank's shard (made on this rank
for optimizer slots and constant initializers, else cut from rank 0's global
initial value), its gradient is summed over the ranks that hold the
same shard (`ShardRouting`, with Horovod process sets as the backend), and
reading it globally (`get_weights`, saving) all-gathers the shards, so every
rank must read it at the same time.
"""

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import values

from tfdist.internal.even_steps import counted_keras_step
from tfdist.internal.keras_steps import is_keras_predict_step, keras_step_kind
from tfdist.core.shards import assemble_global
from tfdist.internal.shard_routing import ShardedVariable, ShardRouting


class HorovodShardedVariable(ShardedVariable):
    """This rank's shard of a global tensor; read globally, it all-gathers the shards."""

    def _get_cross_replica(self):
        extended = self._distribute_strategy.extended
        (local,) = self._values
        shards = extended.hvd.allgather(local.read_value()[tf.newaxis],
                                        name=f"tfdist_read_{extended._next()}")
        return assemble_global(self.layout, tf.unstack(shards, num=self.layout.mesh_shape.size))


class HorovodExtended(ShardRouting, mirrored_strategy.MirroredExtended):
    def __init__(self, container_strategy, hvd, device, mesh, backend, keras_layouts=None):
        super().__init__(container_strategy, devices=[device],
                         cross_device_ops=cross_device_ops_lib.ReductionToOneDevice())
        self.hvd = hvd
        self.mesh = mesh
        self.backend = backend
        self._count = 0
        self._init_routing(keras_layouts)
        with tf.init_scope(), tf.device(device):  # plain variables, not the strategy's
            self._rows = tf.Variable(tf.zeros([hvd.size()], tf.int32), trainable=False,
                                     name="tfdist_rank_rows")
            # Rank r's rows of a global batch of n: [round(n*b[r]), round(n*b[r+1])).
            self._bounds = tf.Variable(tf.range(hvd.size() + 1, dtype=tf.float32) / hvd.size(),
                                       trainable=False, name="tfdist_batch_bounds")
        self.batch_shares = False  # set by HorovodStrategy(batch_shares=...)

    @property
    def _num_replicas_in_sync(self):
        return self.hvd.size()

    def mesh_device_index(self, local_replica: int) -> int:
        return self.hvd.rank() + local_replica

    # -- variables: rank 0's initial values, or each rank's own shard -----------

    _sharded_variable_class = HorovodShardedVariable
    # Each rank makes its own shard (slots, Keras's constant and random
    # initializers: from rank 0's seed); other sharded weights (orthogonal, custom
    # initializers) start from rank 0's global value, broadcast.
    def _shared_seed(self, seed):
        if self.hvd.size() == 1:
            return seed
        return self.hvd.broadcast(seed, root_rank=0, name=f"tfdist_seed_{self._next()}")

    def _create_replicated_variable(self, next_creator, **kwargs):
        initial = kwargs.get("initial_value")
        if initial is not None and self.hvd.size() > 1:
            name = f"tfdist_init_{self._next()}"

            def broadcast_initial():
                value = initial() if callable(initial) else initial
                return self.hvd.broadcast(tf.convert_to_tensor(value), root_rank=0, name=name)

            kwargs["initial_value"] = broadcast_initial
        return mirrored_strategy.MirroredExtended._create_variable(self, next_creator, **kwargs)

    def _global_initial_value(self, value, name):
        if self.hvd.size() == 1:
            return value
        return self.hvd.broadcast(value, root_rank=0, name=f"tfdist_init_{self._next()}")

    def _next(self) -> int:
        self._count += 1
        return self._count

    # -- reductions other than gradients (metrics, strategy.reduce) ------------
    # Gradients go through `ShardRouting.reduce_gradients` and the backend.

    def _allreduce(self, reduce_op, tensors):
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        if self.hvd.size() == 1:
            return tensors
        op = self.hvd.Sum if reduce_op == tf.distribute.ReduceOp.SUM else self.hvd.Average
        return self.hvd.grouped_allreduce(tensors, op=op, name=f"tfdist_reduce_{self._next()}")

    def _local(self, value):
        if isinstance(value, values.DistributedValues):
            return value.values[0]
        return value

    def _reduce_to(self, reduce_op, value, destinations, options):
        (reduced,) = self._allreduce(reduce_op, [self._local(value)])
        return values.Mirrored((reduced,)) if isinstance(value, values.DistributedValues) \
            else reduced

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        reduced = self._allreduce(reduce_op, [self._local(v) for v, _ in value_destination_pairs])
        return [values.Mirrored((r,)) for r in reduced]

    # -- outputs: Keras predict gets every rank's rows --------------------------

    def _gather_counts(self, count):
        """Every rank's rows, through a variable: Horovod's ops are not marked stateful,
        so TF's shape inference would run this all-gather while *tracing* to learn the
        padded shape it feeds (ranks hung there, each waiting for the others). A
        variable read is never evaluated at trace time.

        The name alone, without its name scope: the scope of an op in Keras's
        nested step functions is not the same on every rank (one rank's
        "StatefulPartitionedCall/tfdist_rows_64" waited for the other's "tfdist_rows_64").
        """
        gathered = self.hvd.allgather(count[tf.newaxis], name=f"tfdist_rows_{self._next()}",
                                      ignore_name_scope=True)
        with tf.control_dependencies([self._rows.assign(gathered)]):
            return self._rows.read_value()

    def enable_batch_shares(self) -> None:
        """Every rank reads whole global batches; its steps cut its share (`set_batch_bounds`)."""
        self.batch_shares = True

    def set_batch_bounds(self, bounds) -> None:
        """Rank r takes rows `[round(n * bounds[r]), round(n * bounds[r + 1]))` of every
        global batch of n from the next step on (every rank sets the same bounds)."""
        self._bounds.assign(tf.constant(bounds, tf.float32))

    def _my_rows(self, data):
        """This rank's rows of the whole global batch `data`, by the current bounds: read in
        the step, so every rank cuts the same step's batch with the same bounds."""
        first = next((t for t in tf.nest.flatten(data)
                      if isinstance(t, tf.Tensor) and t.shape.rank), None)
        if first is None:
            return data
        n = tf.cast(tf.shape(first)[0], tf.float32)
        rank = self.hvd.rank()
        start = tf.cast(tf.round(n * self._bounds[rank]), tf.int32)
        end = tf.cast(tf.round(n * self._bounds[rank + 1]), tf.int32)
        return tf.nest.map_structure(
            lambda t: t[start:end] if isinstance(t, tf.Tensor) and t.shape.rank else t, data)

    def _call_for_each_replica(self, fn, args, kwargs):
        if self.hvd.size() == 1:
            return super()._call_for_each_replica(fn, args, kwargs)
        predict = is_keras_predict_step(fn)
        share = self.batch_shares and keras_step_kind(fn) is not None and len(args) == 1 \
            and not kwargs
        fn, args = counted_keras_step(fn, args, kwargs, self._gather_counts,
                                      pad=self._container_strategy().collective_weight_reads)
        if share:  # this rank's share of the whole batch, then counted as its rows
            counted = fn

            def fn(data):  # noqa: F811
                return counted(self._my_rows(data))
        out = super()._call_for_each_replica(fn, args, kwargs)
        if predict:
            out = tf.nest.map_structure(
                lambda t: self.hvd.allgather(self._local(t), name=f"tfdist_predict_{self._next()}",
                                             ignore_name_scope=True),
                out)
        return out

    # -- input: each rank its slice of every global batch ------------------------

    def _experimental_distribute_dataset(self, dataset, options):
        """Each rank's slice of every global batch, as a plain `tf.data.Dataset`.

        With one local replica there is nothing to distribute, so the rank's
        dataset is handed to Keras as it is. TF's distributed dataset would
        wrap it in a `MultiDeviceIterator`, whose prefetch thread can still
        call into an iterator Keras is destroying (the next `fit` drops the
        previous iterator): a segmentation fault in
        `MultiDeviceBuffer::BackgroundThread` -> `DatasetBaseIterator::GetNext`
        on a freed iterator, seen in most runs with each rank pinned to one
        core (`taskset -c RANK`), where that thread is still running when the
        iterator goes. Tested by tests/cluster/test_horovod.py's pinned run.
        """
        del options  # nothing to fetch to: the one device is this process's
        rank, size = self.hvd.rank(), self.hvd.size()
        if self.batch_shares:  # every rank reads whole batches and cuts its share in the step
            return dataset.prefetch(tf.data.AUTOTUNE)

        def my_rows(*batch):
            def part(t):
                # Balanced contiguous slices: a partial last batch is split too
                # (ranks differ by at most one row) instead of losing its remainder.
                n = tf.shape(t)[0]
                return t[rank * n // size:(rank + 1) * n // size]

            out = tf.nest.map_structure(part, batch)
            return out if len(out) > 1 else out[0]

        if size > 1:
            dataset = dataset.map(my_rows)
        return dataset.prefetch(tf.data.AUTOTUNE)  # as TF's iterator prefetched
