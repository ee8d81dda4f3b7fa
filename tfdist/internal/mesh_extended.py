"""MeshExtended and ShardedVariable: true shards under tf.distribute.

Private TF APIs used here (and only here): `MirroredExtended` and its hooks
`_create_variable`, `_batch_reduce_to`, `_reduce_to`, `_update`,
`_use_merge_call`; `MirroredVariable` and its hooks `_get_cross_replica`,
`_update_cross_replica`, `_update_replica`, `_serialize_to_tensors`,
`_restore_from_tensors`.

How a sharded weight trains under an unmodified Keras 3 `fit`:

1. Keras builds the weight with its *global* shape; `_create_variable` gives
   component `i` (on device `i`) slice `i` of the one global initial value.
   Optimizer slots are created "colocated" with the weight and inherit its
   layout, so weights and slots are 1/M per device.
2. In a replica, the weight reads as its local shard; the layer computes on it
   and calls named-axis collectives (`tfdist.collectives`).
3. Keras's optimizer all-reduces *every* gradient over all replicas
   (`_batch_reduce_to`). A sharded weight's read in a replica passes through an
   identity whose gradient function marks the gradient it produces; marked
   gradients skip the global all-reduce. Every other value is reduced, and we
   remember, for each reduced output, the unreduced per-replica inputs.
4. In `_update(var, ...)` a sharded weight looks its gradient up in that
   record and sums the *unreduced* shard gradients over only the replicas that
   hold the same shard. A sharded weight whose gradient was reduced elsewhere
   (so the record lacks it) raises rather than training wrong.

Because the record is keyed by the all-reduce outputs, everything Keras does
before the all-reduce that loses the mark (loss scaling, tied weights summing
two reads) still trains right; those gradients just pay for one unneeded
global reduction.
"""

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import values
from tensorflow.python.distribute import values_util
from tensorflow.python.eager import record
from tensorflow.python.framework import ops

from tfdist.mesh import TensorLayout

LAYOUT_KWARG = "tfdist_layout"
"""Variable-creator keyword that carries a weight's `TensorLayout` to the strategy."""


class ShardedVariable(values.MirroredVariable):
    """A distributed variable whose component `i` is shard `i` of a global tensor.

    In a replica it reads as the local shard; in cross-replica context (saving,
    `get_weights`, Keras's symbolic build) it reads as the global tensor and
    assigning a global value splits it into shards.
    """

    def __init__(self, strategy, values_list, aggregation, layout: TensorLayout):
        super().__init__(strategy, values_list, aggregation)
        self._tfdist_layout = layout

    @property
    def layout(self) -> TensorLayout:
        return self._tfdist_layout

    def _local_replica_id(self):
        """This strategy's replica (or update) id, or None for a global read.

        Outside any strategy TF reports the default replica context's id 0,
        which would read shard 0; only our own replicas read their shard.
        """
        update_id = distribute_lib.get_update_replica_id()
        if update_id is not None:
            return update_id
        ctx = distribute_lib.get_replica_context()
        if ctx is None or ctx.strategy is not self._distribute_strategy:
            return None
        return values_util.get_current_replica_id_as_int()

    def _get(self):
        replica_id = self._local_replica_id()
        if replica_id is None:
            return self._get_cross_replica()
        return self._values[replica_id]

    def _get_cross_replica(self):
        return assemble_global(self._tfdist_layout, [v.read_value() for v in self._values])

    def value(self):
        return self._get()

    def read_value(self):
        return tf.identity(self._get())

    def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
        value = tf.convert_to_tensor(self._get(), dtype=dtype, name=name)
        if distribute_lib.get_update_replica_id() is None and self._local_replica_id() is not None:
            value = self._distribute_strategy.extended.mark_shard_read(value)
        return value

    def __array__(self, dtype=None):
        # Without this, numpy conversion (Keras saving) is delegated to the
        # primary component and would save shard 0.
        return np.asarray(self.read_value().numpy(), dtype=dtype)

    def _update_cross_replica(self, update_fn, value, **kwargs):
        value = tf.convert_to_tensor(value, dtype=self.dtype)
        if value.shape.rank is not None and tuple(value.shape) != self._tfdist_layout.shape:
            raise ValueError(
                f"Cannot assign a value of shape {tuple(value.shape)} to sharded "
                f"variable {self.name!r} of global shape {self._tfdist_layout.shape}."
            )
        shards = split_global(self._tfdist_layout, value)
        index = self._distribute_strategy.extended.mesh_device_index
        updates = []
        for i, component in enumerate(self._values):  # this process's shards only
            shard = shards[index(i)]
            with tf.device(component.device):
                updates.append(update_fn(component, shard, **kwargs))
        if all(isinstance(u, tf.Variable) for u in updates):
            return self
        return tf.group(updates)

    def _update_replica(self, update_fn, value, **kwargs):
        return update_fn(self._get_on_device_or_primary(), value, **kwargs)

    # tf.train.Checkpoint: save and restore the global tensor, not shard 0.
    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": self._get_cross_replica()}

    def _restore_from_tensors(self, restored_tensors):
        return self._update_cross_replica(
            lambda v, x: v.assign(x, read_value=False), restored_tensors["VARIABLE_VALUE"]
        )


def assemble_global(layout: TensorLayout, shards):
    """Concatenates per-device shards (indexed by device) into the global tensor.

    Padding (see `TensorLayout.padded_shape`) is cut off.
    """
    mesh = layout.mesh_shape
    split = [(dim, axis) for dim, axis in enumerate(layout.mesh_axes) if axis in layout.sharded_mesh_axes]

    def build(level, coords):
        if level == len(split):
            full = {n: coords.get(n, 0) for n in mesh.names}
            return shards[mesh.device_index(full)]
        dim, axis = split[level]
        return tf.concat(
            [build(level + 1, {**coords, axis: k}) for k in range(mesh.axis_size(axis))],
            axis=dim,
        )

    full = build(0, {})
    if layout.is_padded:
        full = full[tuple(slice(0, n) for n in layout.shape)]
    return full


def split_global(layout: TensorLayout, value):
    """Splits a global value into per-device shards (zero-padded where the layout pads)."""
    if layout.is_padded:
        value = tf.pad(value, [[0, p - n] for n, p in zip(layout.shape, layout.padded_shape)])
    return [value[layout.shard_slices(i)] for i in range(layout.mesh_shape.size)]


def _identity_chain(t):
    """`t` and each tensor it forwards through Identity/IdentityN ops; [] in eager mode."""
    if tf.executing_eagerly() or not hasattr(t, "op"):
        return []
    chain = [t]
    while t.op.type in ("Identity", "IdentityN"):
        t = t.op.inputs[t.value_index if t.op.type == "IdentityN" else 0]
        chain.append(t)
    return chain


def _source_or_none(t):
    """The tensor `t` forwards through identities, or None in eager mode."""
    chain = _identity_chain(t)
    return chain[-1] if chain else None


class ShardRouting:
    """Mixin for a MirroredExtended whose variables may be `ShardedVariable`s.

    Routes each shard gradient to a reduction over the replicas that hold the
    same shard (see the module docstring); every other value goes to the
    subclass's `_reduce_all`/`_batch_reduce_all` (over all replicas). Needs
    `self.engine` (a collective engine) and `self._devices` (local devices).
    """

    def _init_routing(self):
        self._record_graph = None
        self._reduced = {}
        self._foreign = set()
        self._marked = set()

    def mesh_device_index(self, local_replica: int) -> int:
        """The mesh device index of this process's replica `local_replica`."""
        return local_replica

    def _batch_reduce_all(self, reduce_op, value_destination_pairs, options):
        return mirrored_strategy.MirroredExtended._batch_reduce_to(
            self, reduce_op, value_destination_pairs, options)

    def _reduce_all(self, reduce_op, value, destinations, options):
        return mirrored_strategy.MirroredExtended._reduce_to(
            self, reduce_op, value, destinations, options)

    # -- variables ---------------------------------------------------------

    _sharded_variable_class = ShardedVariable

    def _create_replicated_variable(self, next_creator, **kwargs):
        return mirrored_strategy.MirroredExtended._create_variable(self, next_creator, **kwargs)

    def _global_initial_value(self, value, name):
        """The global initial value every process splits (hook: broadcast it)."""
        return value

    def _create_variable(self, next_creator, **kwargs):
        layout = kwargs.pop(LAYOUT_KWARG, None)
        colocate_with = kwargs.get("colocate_with")
        if layout is None and isinstance(colocate_with, ShardedVariable):
            layout = self._slot_layout(colocate_with, kwargs)
        if layout is None or not layout.is_sharded:
            return self._create_replicated_variable(next_creator, **kwargs)
        kwargs.pop("colocate_with", None)
        return self._create_sharded_variable(next_creator, layout, **kwargs)

    @staticmethod
    def _slot_layout(primary: ShardedVariable, kwargs):
        initial = kwargs.get("initial_value")
        shape = kwargs.get("shape")
        if shape is None and not callable(initial) and initial is not None:
            shape = tf.convert_to_tensor(initial).shape
        if shape is None and callable(initial):
            return primary.layout  # Keras slots: `add_variable_from_reference`.
        if tuple(tf.TensorShape(shape).as_list()) != primary.layout.shape:
            raise ValueError(
                f"A variable of shape {tuple(tf.TensorShape(shape).as_list())} "
                f"colocated with sharded variable {primary.name!r} (global shape "
                f"{primary.layout.shape}, layout {primary.layout}) cannot be "
                f"sharded like it; optimizers whose slots have another shape "
                f"(e.g. factored second moments) are not supported for sharded "
                f"weights."
            )
        return primary.layout

    def _create_sharded_variable(self, next_creator, layout, **kwargs):
        sync = kwargs.get("synchronization", tf.VariableSynchronization.AUTO)
        if sync == tf.VariableSynchronization.ON_READ:
            raise ValueError(
                f"Sharded variable {kwargs.get('name')!r} cannot use "
                f"synchronization=ON_READ."
            )
        kwargs["synchronization"] = tf.VariableSynchronization.ON_WRITE
        aggregation = kwargs.get("aggregation", tf.VariableAggregation.NONE)
        if aggregation is None:
            aggregation = tf.VariableAggregation.NONE
        kwargs.pop("caching_device", None)
        kwargs["collections"] = []
        initial = kwargs["initial_value"]
        with tf.init_scope(), record.stop_recording():
            with tf.device(self._devices[0]):
                value = initial() if callable(initial) else initial
                value = tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))
                value = self._global_initial_value(value, kwargs.get("name"))
        if tuple(value.shape.as_list()) != layout.shape:
            raise ValueError(
                f"Initial value of shape {tuple(value.shape.as_list())} for "
                f"sharded variable {kwargs.get('name')!r} does not match its "
                f"layout {layout}."
            )
        with tf.init_scope(), tf.device(self._devices[0]):
            shards = split_global(layout, value)
        components = []
        for i, device in enumerate(self._devices):
            with tf.device(device), record.stop_recording():
                shard_kwargs = dict(kwargs)
                shard_kwargs["initial_value"] = tf.identity(shards[self.mesh_device_index(i)])
                if i > 0:
                    base = components[0].name.split(":")[0]
                    shard_kwargs["name"] = f"{base}/replica_{i}/"
                components.append(next_creator(**shard_kwargs))
        return self._sharded_variable_class(
            self._container_strategy(), components, aggregation, layout)

    # -- reductions --------------------------------------------------------

    def _current_record(self):
        graph = ops.get_default_graph()
        if self._record_graph is not graph:
            self._record_graph = graph
            self._reduced = {}
            self._foreign = set()
            self._marked = set()
        return self._reduced

    def mark_shard_read(self, value):
        """Identity on a shard's read whose gradient is marked as a shard gradient."""
        if tf.executing_eagerly():
            return value

        @tf.custom_gradient
        def read(x):
            def grad(dy):
                # Dense, also after a gather: sparse (lazy) Adam moments would
                # differ from the single-device reference.
                dy = tf.identity(tf.convert_to_tensor(dy))
                self._current_record()
                self._marked.add(dy.ref())
                return dy

            return tf.identity(x), grad

        return read(value)

    def _components(self, value):
        """The per-replica tensors of `value`, or None if it is not a per-replica value.

        With one local replica (HorovodStrategy) TF hands reductions and updates
        the plain local tensor rather than a one-component `PerReplica`.
        """
        if isinstance(value, values.DistributedVariable):
            return None
        if isinstance(value, values.DistributedValues):
            return value.values
        if len(self._devices) == 1 and isinstance(value, (tf.Tensor, tf.IndexedSlices)):
            return (value,)
        return None

    def _is_marked(self, value) -> bool:
        """Whether every component forwards (through identities) a marked gradient."""
        components = self._components(value)
        if components is None:
            return False
        self._current_record()
        return all(
            any(t.ref() in self._marked for t in _identity_chain(c)) for c in components
        )

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        marked = [self._is_marked(v) for v, _ in value_destination_pairs]
        others = [p for p, m in zip(value_destination_pairs, marked) if not m]
        reduced_others = iter(
            self._batch_reduce_all(reduce_op, others, options) if others else []
        )
        # Shard gradients pass through unreduced; `_update` reduces them per shard group.
        results = [v if m else next(reduced_others)
                   for (v, _), m in zip(value_destination_pairs, marked)]
        reduced = self._current_record()
        for (value, _), result in zip(value_destination_pairs, results):
            result_components = self._components(result)
            if self._components(value) is None or result_components is None:
                continue
            entry = (reduce_op, value)
            for component in result_components:
                src = _source_or_none(component)
                if src is not None:
                    reduced[src.ref()] = entry
        return results

    def _reduce_to(self, reduce_op, value, destinations, options):
        result = self._reduce_all(reduce_op, value, destinations, options)
        self._current_record()
        for component in getattr(result, "values", (result,)):
            src = _source_or_none(component)
            if src is not None and hasattr(src, "ref"):
                self._foreign.add(src.ref())
        return result

    def _update(self, var, fn, args, kwargs, group):
        if isinstance(var, ShardedVariable):
            args = tuple(self._shard_gradient(var, a) for a in args)
        return super()._update(var, fn, args, kwargs, group)

    def _shard_gradient(self, var: ShardedVariable, value):
        """Re-reduces a gradient of `var` over the replicas that share each shard."""
        components = self._components(value)
        if components is None:
            return value
        reduced = self._current_record()
        sources = [_source_or_none(c) for c in components]
        found = [reduced.get(s.ref()) if s is not None else None for s in sources]
        if all(f is None for f in found):
            if any(s is not None and s.ref() in self._foreign for s in sources) or any(
                s is None for s in sources
            ):
                raise ValueError(
                    f"Sharded variable {var.name!r} (layout {var.layout}) received "
                    f"a value that was reduced over all replicas, or whose "
                    f"reduction tfdist cannot trace (eager mode). Its shards differ "
                    f"per device, so that would train it wrong. Train sharded "
                    f"weights inside tf.function (Keras run_eagerly=False) and "
                    f"let the optimizer reduce gradients."
                )
            return value  # Unreduced per-replica value (e.g. gradient accumulation).
        if any(f is None or f is not found[0] for f in found):
            raise ValueError(
                f"Gradient components of sharded variable {var.name!r} come from "
                f"different reductions; cannot route them to their shards."
            )
        reduce_op, unreduced = found[0]
        groups = var.layout.shard_owner_groups()
        out = []
        for i, local in enumerate(self._components(unreduced)):
            index = self.mesh_device_index(i)
            group = next(g for g in groups if index in g)
            with tf.device(self._devices[i]):  # every op on the shard's device
                local = tf.convert_to_tensor(local)  # IndexedSlices -> dense shard
                summed = self.engine.all_reduce(local, index, group)
                if reduce_op == tf.distribute.ReduceOp.MEAN:
                    summed = summed / len(group)
            out.append(summed)
        return values.PerReplica(tuple(out))


class MeshExtended(ShardRouting, mirrored_strategy.MirroredExtended):
    """MirroredExtended whose variables may be shards; see the module docstring."""

    def __init__(self, container_strategy, mesh, devices, engine):
        # MirroredExtended refuses devices of several tasks in eager mode; a
        # single controller driving remote workers (like TPUStrategy) is what
        # tfdist's mesh over workers is, so initialise on the first device and
        # then on all of them.
        super().__init__(
            container_strategy,
            devices=devices[:1],
            cross_device_ops=cross_device_ops_lib.ReductionToOneDevice(),
        )
        self._initialize_strategy(devices)
        self.mesh = mesh
        self.engine = engine
        self._init_routing()

    # -- execution ---------------------------------------------------------

    def _use_merge_call(self):
        return True
