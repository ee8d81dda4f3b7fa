"""MeshExtended and ShardedVariable: true shards under tf.distribute.

Private TF APIs used here (and only here): `MirroredExtended` and its hooks
`_create_variable`, `_update`, `_use_merge_call`, `_call_for_each_replica`
(`_initialize_strategy` through `tfdist.internal.single_controller`);
`MirroredVariable` and its hooks `_get_cross_replica`,
`_update_cross_replica`, `_update_replica`, `_serialize_to_tensors`,
`_restore_from_tensors`.

How a sharded weight trains under an unmodified Keras 3 `fit`:

1. Keras builds the weight with its *global* shape; `_create_variable` gives
   component `i` (on device `i`) slice `i` of the one global initial value.
   Optimizer slots are created "colocated" with the weight and inherit its
   layout, so weights and slots are 1/M per device.
2. In a replica, the weight reads as its local shard; the layer computes on it
   and calls named-axis collectives (`tfdist.collectives`).
3. Keras's optimizer hands its `(gradient, variable)` pairs, before any
   reduction, to the seam attached to it when it was created here
   (`tfdist.internal.gradient_seam`), which passes them, in one merge call, to
   `ShardRouting.reduce_gradients`: replicated weights' gradients are summed
   over all replicas (fused buckets on the mesh's backend), sharded weights'
   gradients over the replicas that hold the same shard.
4. `_update(var, ...)` applies each replica's reduced gradient to its own
   component. A trainable sharded weight whose gradient was not routed in
   the same graph raises rather than training wrong.
5. ZeRO-1/2 (`zero_stage`): a weight stored split over the batch axis keeps a
   whole copy (`KeptWhole`) that replicas read; `refresh_kept_in_replica`
   all-gathers the new shards into it after each optimizer step, and every
   other assignment refreshes it (`refresh_kept_whole`).
"""

import contextlib
from typing import Optional

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import values
from tensorflow.python.distribute import values_util
from tensorflow.python.eager import record
from tensorflow.python.framework import ops

from tfdist import collectives, weight_reads
from tfdist.clipping import clip_global
from tfdist.internal import keras_h5_slices, keras_loop_reads, keras_variables
from tfdist.internal import gradient_seam, keras_tensor_parallel, single_controller
from tfdist.internal.even_steps import even_keras_step
from tfdist.core.shards import LAYOUT_KWARG, assemble_global, split_global
from tfdist.core import placement as placement_lib
from tfdist.core import routing
from tfdist.core.zero import KeptWhole, own_slice, whole_gradient
from tfdist.mesh import TensorLayout

class ShardedVariable(values.MirroredVariable):
    """A distributed variable whose component `i` is shard `i` of a global tensor.

    In a replica it reads as the local shard, or, for a weight laid out by a
    Keras `LayoutMap`, as the whole weight gathered from its
    shards (FSDP: `tfdist.weight_reads`); in cross-replica context (saving,
    `get_weights`, Keras's symbolic build) it reads as the global tensor and
    assigning a global value splits it into shards.
    """

    def __init__(self, strategy, values_list, aggregation, layout: TensorLayout):
        super().__init__(strategy, values_list, aggregation)
        self._tfdist_layout = layout
        self._tfdist_gather_on_read = False  # set by `ShardRouting._create_variable`
        self._tfdist_kept: Optional[KeptWhole] = None  # ZeRO-1/2: set there too

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
        if self._tfdist_gather_on_read and distribute_lib.get_update_replica_id() is None:
            # Inside a loop of a Keras call: read once, before the loop.
            return keras_loop_reads.read_once(self, weight_reads.kept_local(),
                                              lambda: self._read_whole(replica_id))
        return self._values[replica_id]

    def _read_whole(self, replica_id):
        """This replica's read of a `LayoutMap` weight: gathered as `weight_reads` says."""
        kept = self._tfdist_kept
        if kept is not None:
            return weight_reads.read_kept(self._values[replica_id], kept.copy.values[replica_id],
                                          kept.axis, kept.dim, kept.base,
                                          whole_gradient=kept.whole_gradient)
        return weight_reads.read_in_replica(self._tfdist_layout, self._values[replica_id])

    def _get_cross_replica(self):
        return assemble_global(self._tfdist_layout, [v.read_value() for v in self._values])

    def value(self):
        return self._get()

    def read_value(self):
        return tf.identity(self._get())

    def _dense_var_to_tensor(self, dtype=None, name=None, as_ref=False):
        return tf.convert_to_tensor(self._get(), dtype=dtype, name=name)

    def __array__(self, dtype=None):
        # Without this, numpy conversion (Keras saving) is delegated to the
        # primary component and would save shard 0.
        return np.asarray(self.read_value().numpy(), dtype=dtype)

    # A Keras weights file's dataset (`keras_h5_slices.H5Slices`) is assigned
    # here unread, and each shard reads its own slice of it.
    _tfdist_assign_slices = True

    def _update_cross_replica(self, update_fn, value, **kwargs):
        keras_loop_reads.before_assign(self)
        layout = self._tfdist_layout
        if isinstance(value, keras_h5_slices.H5Slices) and not layout.is_padded:
            read = {}  # one read per distinct shard of this process

            def shard_of(device):
                slices = layout.shard_slices(device)
                key = tuple((s.start, s.stop) for s in slices)
                if key not in read:
                    read[key] = tf.cast(value.read(slices), self.dtype)
                return read[key]
        else:
            value = tf.convert_to_tensor(value, dtype=self.dtype)
            if value.shape.rank is not None and tuple(value.shape) != layout.shape:
                raise ValueError(
                    f"Cannot assign a value of shape {tuple(value.shape)} to sharded "
                    f"variable {self.name!r} of global shape {layout.shape}."
                )
            shards = split_global(layout, value)

            def shard_of(device):
                return shards[device]

        index = self._distribute_strategy.extended.mesh_device_index
        updates = []
        for i, component in enumerate(self._values):  # this process's shards only
            shard = shard_of(index(i))
            with tf.device(component.device):
                updates.append(update_fn(component, shard, **kwargs))
        eager = all(isinstance(u, tf.Variable) for u in updates)
        if self._tfdist_kept is not None:
            with tf.control_dependencies(None if eager else updates):
                updates.append(self.refresh_kept_whole())
        if eager:
            return self
        return tf.group(updates)

    def refresh_kept_whole(self):
        """In cross-replica context: ZeRO's kept whole copy assigned this weight's value.

        For assignments outside the optimizer (loading, `set_weights`, EMA's
        overwrite); the optimizer's steps refresh it in the replicas
        (`refresh_kept_in_replica`). A no-op without a kept copy.
        """
        kept = self._tfdist_kept
        if kept is None:
            return tf.no_op()
        return kept.copy.assign(self._get_cross_replica(), read_value=False)

    def _update_replica(self, update_fn, value, **kwargs):
        keras_loop_reads.before_assign(self)
        return update_fn(self._get_on_device_or_primary(), value, **kwargs)

    # tf.train.Checkpoint: save and restore the global tensor, not shard 0.
    def _serialize_to_tensors(self):
        return {"VARIABLE_VALUE": self._get_cross_replica()}

    def _restore_from_tensors(self, restored_tensors):
        return self._update_cross_replica(
            lambda v, x: v.assign(x, read_value=False), restored_tensors["VARIABLE_VALUE"]
        )


def refresh_kept_in_replica(variables) -> None:
    """In a replica, after an optimizer step: the ZeRO weights' kept copies gathered anew.

    ZeRO's all-gather of the updated parameters, fused: this device's new
    shards of every weight kept whole over the same axis (and of one dtype)
    travel flattened in one all-gather, and each device rebuilds every whole
    weight from the gathered pieces into its component of the copy.
    """
    groups = {}
    for variable in variables:
        var = variable if isinstance(variable, tf.Variable) else variable.value  # Keras's
        kept = getattr(var, "_tfdist_kept", None)
        if kept is not None:
            groups.setdefault((kept.axis, var.dtype), []).append(var)
    if not groups:
        return
    replica = values_util.get_current_replica_id_as_int()
    for (axis, _), group in groups.items():
        shards = [v.values[replica].read_value() for v in group]
        flat = tf.concat([tf.reshape(s, [-1]) for s in shards], axis=0)
        gathered = collectives.all_gather(flat[tf.newaxis], axis, dim=0)  # [N, total]
        n = collectives.axis_size(axis)
        offset = 0
        for var, shard in zip(group, shards):
            size = shard.shape.num_elements()
            pieces = tf.reshape(gathered[:, offset:offset + size], [n] + shard.shape.as_list())
            kept = var._tfdist_kept
            whole = tf.concat(tf.unstack(pieces, num=n), axis=kept.dim)
            kept.copy.values[replica].assign(whole, read_value=False)
            offset += size


def replica_tensors(structure):
    """Every tensor in `structure`, each distributed value's components in replica order."""
    out = []
    for leaf in tf.nest.flatten(structure):
        if isinstance(leaf, values.DistributedValues):
            out.extend(v for v in leaf.values if isinstance(v, tf.Tensor))
        elif isinstance(leaf, tf.Tensor):
            out.append(leaf)
    return out


def _slot_shape(kwargs):
    """A slot's shape from its creation arguments (`placement.SLOT_FROM_REFERENCE` for
    Keras's slots, made from a callable initial value without a shape)."""
    initial, shape = kwargs.get("initial_value"), kwargs.get("shape")
    if shape is None and callable(initial):
        return placement_lib.SLOT_FROM_REFERENCE
    if shape is None and initial is not None:
        shape = tf.convert_to_tensor(initial).shape
    return tuple(tf.TensorShape(shape).as_list())


def _drop_padding(slices):
    """`slices` without its padding entries (index -1, `tfdist.collectives`).

    A sharded weight read whole (FSDP) or looked up on its shard gets padding
    entries for rows other devices hold; they must touch no row, and an index
    -1 is out of range for the scatter updates Keras's TF optimizer applies
    sparse gradients with.
    """
    keep = slices.indices >= 0
    return tf.IndexedSlices(tf.boolean_mask(slices.values, keep),
                            tf.boolean_mask(slices.indices, keep), slices.dense_shape)


def _dense(value, var, i):
    """A gradient as a dense tensor of component `i` of `var`'s static shape.

    An `IndexedSlices` is scattered into zeros: only for gradients that are
    summed, a sharded weight's, whose shard is computed densely by tfdist's
    layers (a replicated weight's sparse gradient is gathered instead,
    `ShardRouting._gather_slices`). TF loses static shapes on some gradient
    paths (a `Tensordot` of a partly unknown input); fusion needs them.
    """
    value = tf.convert_to_tensor(value)
    shape = (var.values[i] if isinstance(var, values.DistributedValues) else var).shape
    if whole_gradient(var):  # ZeRO-1: the whole gradient, the map's layout's shape
        shape = var._tfdist_kept.copy.values[i].shape
    if not value.shape.is_fully_defined():
        value = tf.ensure_shape(value, shape)
    return value


class ShardRouting:
    """Mixin for a MirroredExtended whose variables may be `ShardedVariable`s.

    Gradients reach `reduce_gradients` paired with their variables (through the
    optimizer's seam, `tfdist.internal.gradient_seam`), before any reduction;
    the plan (`tfdist.core.routing`) comes from the variables' layouts:

    - a replicated weight's gradient is summed over every replica, all of them
      fused into a few buckets (`Backend.batch_all_reduce`); a sparse one
      (`IndexedSlices`, a Keras `Embedding`) is gathered and stays sparse;
    - a sharded weight's gradient is summed over the replicas that hold the
      same shard (`TensorLayout.shard_owner_groups`), fused per group;
    - then the optimizer's clipping applies to the reduced gradients with
      norms of the global tensors (`tfdist.clipping`): exactly one device's.

    Everything else TF reduces (metrics, `strategy.reduce`) goes to the
    subclass's `_batch_reduce_to`/`_reduce_to`. A trainable sharded weight
    updated from a gradient that did not pass `reduce_gradients` in the same
    graph (a custom loop that all-reduced it over every replica) raises rather
    than training wrong. Needs `self.backend` and `self._devices` (local devices).
    """

    keras_layouts = None
    """A `tfdist.keras_layouts.KerasLayouts`: layouts of Keras variables by path, or None."""

    def _init_routing(self, keras_layouts=None):
        self.keras_layouts = keras_layouts
        self._routed_graph = None
        self._routed = set()
        self._direct = False

    # -- cross-replica updates (tfdist.internal.gradient_seam) ---------------

    def _use_merge_call(self):
        # Inside `direct_updates` Keras's `maybe_merge_call(fn, strategy)` must
        # call `fn` directly: the caller is already in cross-replica context.
        return not self._direct

    @contextlib.contextmanager
    def direct_updates(self, variables):
        """Cross-replica updates of `variables` from gradients routed in this graph.

        For the seam's updates (`tfdist.internal.gradient_seam`), some inside a cond:
        the cond's branch is a graph of its own, so the variables whose
        gradients `reduce_gradients` routed outside it are marked routed in it.
        """
        self._routed_set().update(id(v) for v in variables if isinstance(v, ShardedVariable))
        previous, self._direct = self._direct, True
        try:
            yield
        finally:
            self._direct = previous

    def map_components(self, fn, *values, like):
        """`fn` of the values' per-replica components, distributed like variable `like`."""
        parts = [self._components(v) for v in values]
        out = []
        for i in range(len(self._devices)):
            with tf.device(self._devices[i]):
                out.append(fn(*(p[i] for p in parts)))
        return self._wrap(out, mirrored=not isinstance(like, ShardedVariable))

    def global_sum_of_squares(self, shard, var):
        """The sum of squares of the global tensor `shard` is this update's shard of.

        For an optimizer's update of sharded variable `var`, on the device being
        updated (`extended.update`): every shard is held by the same number of
        replicas, so the sum over all replicas divided by that number is the
        sum over the distinct shards. One collective per call; every device
        calls it in the same order, as the update runs variable by variable.
        """
        i = distribute_lib.get_update_replica_id()
        if i is None:
            raise ValueError(f"global_sum_of_squares({var.name!r}) outside an update.")
        owners = len(var.layout.shard_owner_groups()[0])
        local = tf.reduce_sum(tf.square(tf.cast(shard, tf.float32))) / owners
        total = self.backend.all_reduce(tf.reshape(local, [1]), self.mesh_device_index(i),
                                        tuple(range(self.mesh.size)))
        return tf.cast(tf.reshape(total, []), shard.dtype)

    def clip(self, clipping, grads, variables):
        """Reduced, distributed gradients (as `reduce_gradients` returns them), clipped."""
        if not clipping.active:
            return list(grads)
        reduced = [list(self._components(g)) for g in grads]
        self._clip(clipping, reduced, variables)
        return [self._wrap(r, mirrored=not isinstance(v, ShardedVariable))
                for r, v in zip(reduced, variables)]

    def mesh_device_index(self, local_replica: int) -> int:
        """The mesh device index of this process's replica `local_replica`."""
        return local_replica

    def refresh_kept(self, variables) -> None:
        """In a replica, after an optimizer step: ZeRO's kept copies of `variables` gathered anew."""
        refresh_kept_in_replica(variables)

    # -- variables ---------------------------------------------------------

    _sharded_variable_class = ShardedVariable

    def _create_replicated_variable(self, next_creator, **kwargs):
        return mirrored_strategy.MirroredExtended._create_variable(self, next_creator, **kwargs)

    def _global_initial_value(self, value, name):
        """The global initial value every process splits (hook: broadcast it)."""
        return value

    def _create_variable(self, next_creator, **kwargs):
        optimizer = gradient_seam.optimizer_being_created()
        if optimizer is not None:  # the seam's one install point: the optimizer's first variable
            gradient_seam.attach(optimizer, self._container_strategy())
        elif self.keras_layouts is not None:  # Keras layers built under a LayoutMap
            keras_tensor_parallel.attach_to_layers_being_built()
        colocate_with = kwargs.get("colocate_with")
        keras_variable = None
        if colocate_with is None and self.keras_layouts is not None:
            keras_variable = keras_variables.keras_variable_of(kwargs.get("initial_value"))
        slot_of = colocate_with if isinstance(colocate_with, ShardedVariable) else None
        placement = placement_lib.place(
            kwargs.pop(LAYOUT_KWARG, None), slot_of=slot_of,
            slot_shape=_slot_shape(kwargs) if slot_of is not None else None,
            keras_path=None if keras_variable is None else keras_variable.path,
            keras_shape=None if keras_variable is None else keras_variable.shape,
            trainable=kwargs.get("trainable", True), keras_layouts=self.keras_layouts)
        if placement.gather_on_read:  # a LayoutMap weight: its layout recorded on it
            keras_variables.set_layout(keras_variable, placement.layout,
                                       keeps_whole=placement.keeps_whole)
        if not placement.sharded:
            return self._create_replicated_variable(next_creator, **kwargs)
        layout = placement.layout
        kwargs.pop("colocate_with", None)
        # Slots (zeros) and Keras weights from Keras's constant and random
        # initializers: each shard made on its own device, never the whole value.
        make_shard = keras_variables.shard_maker(
            keras_variables.initializer_of(kwargs.get("initial_value")), layout,
            kwargs.get("dtype"), share_seed=self._shared_seed)
        variable = self._create_sharded_variable(next_creator, layout, make_shard=make_shard,
                                                 **kwargs)
        variable._tfdist_gather_on_read = placement.gather_on_read
        if placement.keeps_whole:
            variable._tfdist_kept = self._create_kept_whole(next_creator, variable,
                                                            placement.kept_base, kwargs)
        return variable

    def _create_kept_whole(self, next_creator, variable, base, kwargs) -> KeptWhole:
        """ZeRO's whole copy of `variable`, laid out `base`, from its initial shards."""
        axes = variable.layout.mesh_axes
        base_axes = (None,) * len(axes) if base is None else base.mesh_axes
        dim = next(d for d, (a, b) in enumerate(zip(axes, base_axes)) if a != b)
        axis = axes[dim]
        name = (kwargs.get("name") or "variable").split(":")[0]
        copy_kwargs = dict(initial_value=variable._get_cross_replica, trainable=False,
                           dtype=variable.dtype, name=f"{name}_whole",
                           synchronization=tf.VariableSynchronization.ON_WRITE,
                           aggregation=tf.VariableAggregation.NONE)
        if base is None or not base.is_sharded:
            copy = self._create_replicated_variable(next_creator, **copy_kwargs)
        else:
            copy = self._create_sharded_variable(next_creator, base, **copy_kwargs)
        return KeptWhole(copy=copy, base=base, axis=axis, dim=dim,
                         whole_gradient=self.keras_layouts.zero_stage == 1)

    def _shared_seed(self, seed):
        """The seed every process draws a variable's random shards from (one process: its own)."""
        return seed

    def _create_sharded_variable(self, next_creator, layout, make_shard=None, **kwargs):
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
        if make_shard is not None:
            return self._create_from_shards(next_creator, layout, make_shard, aggregation,
                                            kwargs)
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
        return self._sharded_from(next_creator, layout, aggregation, kwargs,
                                  lambda i: shards[self.mesh_device_index(i)])

    def _sharded_from(self, next_creator, layout, aggregation, kwargs, shard_for):
        """The `ShardedVariable` whose component `i` starts from `shard_for(i)` on device `i`."""
        components = []
        for i, device in enumerate(self._devices):
            with tf.device(device), record.stop_recording():
                shard_kwargs = dict(kwargs, initial_value=tf.identity(shard_for(i)))
                if i > 0:
                    base = components[0].name.split(":")[0]
                    shard_kwargs["name"] = f"{base}/replica_{i}/"
                components.append(next_creator(**shard_kwargs))
        return self._sharded_variable_class(
            self._container_strategy(), components, aggregation, layout)

    def _create_from_shards(self, next_creator, layout, make_shard, aggregation, kwargs):
        """Each distinct shard made once, on the first device that holds it, then copied
        to the other devices that hold it; no device holds the whole value."""
        shard_of = {}  # device index -> distinct shard number
        for number, group in enumerate(layout.shard_owner_groups()):
            for index in group:
                shard_of[index] = number
        made = {}

        def shard_for(i):  # called on device i
            index = self.mesh_device_index(i)
            if shard_of[index] not in made:
                with tf.init_scope(), tf.device(self._devices[i]):
                    made[shard_of[index]] = tf.convert_to_tensor(make_shard(index),
                                                                 dtype=kwargs.get("dtype"))
            return made[shard_of[index]]

        return self._sharded_from(next_creator, layout, aggregation, kwargs, shard_for)

    # -- gradients: routed by variable ---------------------------------------

    def _components(self, value):
        """The per-replica tensors of `value` (one per local device).

        With one local replica (HorovodStrategy) TF hands merge calls and
        updates the plain local tensor rather than a one-component `PerReplica`.
        """
        if isinstance(value, values.DistributedValues):
            return tuple(value.values)
        return (value,) if len(self._devices) == 1 else None

    def _wrap(self, components, mirrored: bool):
        if len(self._devices) == 1:
            return components[0]
        return (values.Mirrored if mirrored else values.PerReplica)(tuple(components))

    def _routed_set(self):
        graph = ops.get_default_graph()
        if self._routed_graph is not graph:
            self._routed_graph, self._routed = graph, set()
        return self._routed

    def reduce_gradients(self, grads_and_vars, clipping=None):
        """Sums each gradient over the replicas its variable needs; the data path.

        Called in cross-replica context (a merge call) with every replica's
        gradient of each variable (eagerly, from a custom loop's `strategy.run`,
        summed on each device without collectives; a tensor that is the same in
        every replica taken as the global gradient, as MirroredStrategy takes
        it). Returns the reduced gradients in order:
        `Mirrored` for replicated variables, `PerReplica` shards for sharded
        ones; clipped by `clipping` (a `tfdist.clipping.Clipping`) on the
        reduced, global gradient.
        """
        grads_and_vars = list(grads_and_vars)
        n_local = len(self._devices)
        # Eagerly (a custom loop's `strategy.run` outside tf.function) the replicas ran
        # one after another and their gradients are all here: summed on each device
        # without collectives, which would wait for peers that never come.
        eager = tf.executing_eagerly() and n_local > 1
        routed = self._routed_set()
        components, kinds = [], []
        for grad, var in grads_and_vars:
            parts = self._components(grad)
            if parts is None and not isinstance(var, ShardedVariable):
                # The same tensor in every replica (made outside `strategy.run`):
                # MirroredStrategy applies it as it is, once, and so does tfdist.
                components.append((grad,) * n_local)
                kinds.append(routing.AS_IS)
                continue
            if parts is None or (eager and isinstance(var, ShardedVariable)):
                raise ValueError(
                    f"tfdist expected one gradient per replica for {var.name!r}; received "
                    f"{grad!r}." if parts is None else
                    f"Sharded variable {var.name!r} (layout {var.layout}) gets its "
                    f"gradient in an eager `strategy.run`: its shards' gradients are "
                    f"summed by collectives, which run inside tf.function only. Wrap the "
                    f"step in tf.function.")
            if isinstance(var, ShardedVariable):
                routed.add(id(var))
            components.append(parts)
            kinds.append(routing.SPARSE if all(isinstance(c, tf.IndexedSlices) for c in parts)
                         else routing.DENSE)
        variables = [v for _, v in grads_and_vars]
        plan = routing.plan_reduction(variables, kinds,
                                      [self.mesh_device_index(i) for i in range(n_local)],
                                      self.mesh.size)
        reduced = [[None] * n_local for _ in grads_and_vars]
        for i in range(n_local):
            index = self.mesh_device_index(i)
            with tf.device(self._devices[i]):
                for k in plan.as_is:
                    reduced[k][i] = tf.identity(components[k][i])
                if eager:  # every gradient here is a replicated weight's
                    for k in plan.sparse[i]:
                        parts = components[k]
                        reduced[k][i] = _drop_padding(tf.IndexedSlices(
                            tf.concat([p.values for p in parts], 0),
                            tf.concat([p.indices for p in parts], 0), parts[0].dense_shape))
                    for positions in plan.dense[i].values():
                        for k in positions:
                            reduced[k][i] = tf.add_n([_dense(p, variables[k], j)
                                                      for j, p in enumerate(components[k])])
                    continue
                for k, group in plan.sparse[i].items():
                    reduced[k][i] = own_slice(_drop_padding(
                        self._gather_slices(components[k][i], index, group)), variables[k], index)
                for group, positions in plan.dense[i].items():
                    dense = [_dense(components[k][i], variables[k], i) for k in positions]
                    for k, r in zip(positions, self.backend.batch_all_reduce(dense, index, group)):
                        reduced[k][i] = own_slice(r, variables[k], index)
        if clipping is not None and clipping.active:
            self._clip(clipping, reduced, [v for _, v in grads_and_vars])
        return [self._wrap(r, mirrored=not isinstance(v, ShardedVariable))
                for r, (_, v) in zip(reduced, grads_and_vars)]

    def _gather_slices(self, slices, index, group):
        """Every replica's `IndexedSlices` rows, concatenated in device order.

        A weight read with `tf.gather` (a Keras `Embedding`) gets an
        `IndexedSlices` gradient, one row per looked-up id. Keras's optimizers
        treat it sparsely (Adam updates the moments of those rows only), so it
        must stay sparse: its sum over the replicas of `group` (all of them for
        a replicated weight, a shard's owners for a sharded one) is the
        concatenation of their rows, the same rows in the same order as one
        device's gradient of the whole batch (replicas hold consecutive slices
        of it), as MirroredStrategy gathers it too.
        """
        if len(group) == 1:
            return slices
        return tf.IndexedSlices(
            self.backend.all_gather(slices.values, index, group),
            self.backend.all_gather(slices.indices, index, group),
            slices.dense_shape)

    def _clip(self, clipping, reduced, variables):
        """Clips `reduced[k][i]` in place, replica by replica, on global norms."""
        sharded = [isinstance(v, ShardedVariable) for v in variables]
        owners = [len(v.layout.shard_owner_groups()[0]) if s else 1
                  for v, s in zip(variables, sharded)]
        everyone = tuple(range(self.mesh.size))
        for i in range(len(self._devices)):
            index = self.mesh_device_index(i)
            with tf.device(self._devices[i]):
                clipped = clip_global(
                    clipping, [r[i] for r in reduced], sharded, owners,
                    lambda x, index=index: self.backend.all_reduce(x, index, everyone))
            for r, c in zip(reduced, clipped):
                r[i] = c

    def _update(self, var, fn, args, kwargs, group):
        if (isinstance(var, ShardedVariable) and var.trainable and args
                and id(var) not in self._routed_set() and not tf.executing_eagerly()):
            raise ValueError(
                f"Sharded variable {var.name!r} (layout {var.layout}) is being updated "
                f"from a value that tfdist did not route: its shards differ per device, "
                f"so a gradient all-reduced over every replica would train it wrong. "
                f"Apply gradients with a Keras optimizer (`model.fit`, "
                f"`optimizer.apply_gradients` inside `strategy.run`), which tfdist "
                f"routes per shard.")
        result = super()._update(var, fn, args, kwargs, group)
        if getattr(var, "_tfdist_kept", None) is not None and tf.executing_eagerly():
            # An eager update (Keras's `finalize_variable_values` writing EMA averages
            # after `fit`); a step's updates refresh the copy in the replicas after.
            var.refresh_kept_whole()
        return result


class MeshExtended(ShardRouting, mirrored_strategy.MirroredExtended):
    """MirroredExtended whose variables may be shards; see the module docstring."""

    def __init__(self, container_strategy, mesh, devices, backend, keras_layouts=None):
        # MirroredExtended refuses devices of several tasks in eager mode; a
        # single controller driving remote workers (like TPUStrategy) is what
        # tfdist's mesh over workers is, so initialise on the first device and
        # then on all of them, the scope's eager ops left on the controller.
        super().__init__(
            container_strategy,
            devices=devices[:1],
            cross_device_ops=cross_device_ops_lib.ReductionToOneDevice(),
        )
        single_controller.initialize_on_devices(self, devices)
        self.mesh = mesh
        self.backend = backend
        self._init_routing(keras_layouts)

    # -- execution ---------------------------------------------------------

    def _call_for_each_replica(self, fn, args, kwargs):
        # After a trace that failed part-way, the devices' collective keys must
        # agree again before the next one (see `TFCollectiveBackend.resync`).
        self.backend.resync()
        fn, args = even_keras_step(fn, args, kwargs, self._devices)
        with self.backend.step_shapes(replica_tensors((args, kwargs))):
            return super()._call_for_each_replica(fn, args, kwargs)
