"""AveragingExtended: local SGD with periodic model averaging (and BMUF).

Private TF APIs used here (and only here): `MirroredExtended` and its hooks
`_create_variable`, `_batch_reduce_to`, `_update`, `_use_merge_call`,
`_call_for_each_replica` (`_initialize_strategy` through
`tfdist.internal.single_controller`).

Under an unmodified Keras `fit`:

1. Keras all-reduces the gradients (`_batch_reduce_to`); here each replica
   keeps its own. Keras scaled the loss by 1/N for a sum, so a SUM returns
   N times the replica's gradient: the gradient of its own mean loss.
2. `_update(var, ...)` applies each replica's gradient to its own copy
   (component) of the weight, then counts the update; every `period`-th
   update of a weight averages its copies over the replicas with one
   collective all-reduce (and, with `average_slots`, its optimizer slots,
   found as the variables Keras creates colocated with it).
3. Block momentum (BMUF, Chen & Huo 2016): with `block_momentum` mu > 0 the
   average is a block gradient G = mean - w_g applied to a global copy w_g
   with momentum, Delta = mu * Delta + block_lr * G, w_g += Delta, and the
   replicas restart from w_g + mu * Delta (Nesterov).

With `period=1`, no block momentum and plain SGD this equals synchronous
data-parallel SGD (tested).

A partial batch reaches the replicas unevenly (`_call_for_each_replica`,
`tfdist.internal.even_steps` without padding): a replica's mean loss is its
rows' sum over the batch's mean rows per replica (the full-batch loss when
the replicas are even, a zero gradient for a replica without rows), so with
`period=1` and SGD a partial batch too trains exactly as on one device.
"""

import tensorflow as tf
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import values

from tfdist.internal import single_controller
from tfdist.internal.even_steps import even_keras_step


class AveragingExtended(mirrored_strategy.MirroredExtended):
    def __init__(self, container_strategy, devices, engine, period, average_slots,
                 block_momentum, block_lr):
        super().__init__(container_strategy, devices=devices[:1],
                         cross_device_ops=cross_device_ops_lib.ReductionToOneDevice())
        single_controller.initialize_on_devices(self, devices)  # may span tasks
        self.engine = engine
        self.period = period
        self.average_slots = average_slots
        self.block_momentum = block_momentum
        self.block_lr = block_lr
        self._slots = {}  # id(primary) -> [slot variables]
        self._state = {}  # id(var) -> (counter, global copy, momentum)
        self._averaged = []  # the variables of `_state`, in the order their state was made
        self._pending = {}  # restored state for variables whose state is not made yet
        self.averaged_bytes = 0  # bytes of every variable averaged, for the metric

    def _use_merge_call(self):
        return True

    def _call_for_each_replica(self, fn, args, kwargs):
        fn, args = even_keras_step(fn, args, kwargs, self._devices, pad=False)
        return super()._call_for_each_replica(fn, args, kwargs)

    def _create_variable(self, next_creator, **kwargs):
        primary = kwargs.get("colocate_with")
        var = super()._create_variable(next_creator, **kwargs)
        if isinstance(primary, values.MirroredVariable):
            self._slots.setdefault(id(primary), []).append(var)
        return var

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        n = len(self._devices)
        out = []
        for value, _ in value_destination_pairs:
            if not isinstance(value, values.PerReplica):
                out.append(value)
                continue
            if reduce_op == tf.distribute.ReduceOp.SUM:
                parts = []
                for i, v in enumerate(value.values):
                    with tf.device(self._devices[i]):
                        parts.append(tf.convert_to_tensor(v) * n)
                value = values.PerReplica(tuple(parts))
            out.append(value)
        return out

    def _update(self, var, fn, args, kwargs, group):
        result = super()._update(var, fn, args, kwargs, group)
        # Only optimizer steps (per-replica gradients, in a traced step) count;
        # assignments such as `set_weights` write every copy and are left alone.
        from_optimizer = any(isinstance(a, values.PerReplica) for a in args)
        if not (from_optimizer and getattr(var, "trainable", False)) or tf.executing_eagerly():
            return result
        counter, global_copy, momentum = self._state_of(var)
        deps = [d for d in tf.nest.flatten(result) if d is not None]
        with tf.control_dependencies(deps):
            with tf.device(self._devices[0]):
                count = counter.assign_add(1)
                sync = tf.equal(count % self.period, 0)
            synced = tf.cond(sync, lambda: self._average(var, global_copy, momentum),
                             lambda: tf.constant(False))
        if group:
            with tf.control_dependencies([synced]):
                return tf.group(deps)
        return result

    def _state_of(self, var):
        if id(var) not in self._state:
            with tf.init_scope(), tf.device(self._devices[0]):
                counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                      name="tfdist_average_counter")
                global_copy = momentum = None
                if self.block_momentum:
                    global_copy = tf.Variable(var.values[0].read_value(), trainable=False,
                                              name="tfdist_bmuf_global")
                    momentum = tf.Variable(tf.zeros_like(var.values[0]), trainable=False,
                                           name="tfdist_bmuf_delta")
            self._state[id(var)] = (counter, global_copy, momentum)
            self._averaged.append(var)
            k = len(self._averaged) - 1
            if k in self._pending:
                self._restore(k, self._pending.pop(k))
            self.averaged_bytes += var.values[0].shape.num_elements() * var.dtype.size
            if self.average_slots:
                for slot in self._slots.get(id(var), []):
                    self.averaged_bytes += slot.values[0].shape.num_elements() * slot.dtype.size
        return self._state[id(var)]

    # -- checkpoints: counters, BMUF state and every replica's copy ----------

    def _copies(self, var):
        """The variables whose per-replica copies differ between averagings: var and its slots."""
        return [var] + (self._slots.get(id(var), []) if self.average_slots else [])

    def state_arrays(self) -> dict:
        """`{name: array}`: per averaged weight, its counter, BMUF state and replica copies.

        Between averagings the replicas' copies differ, and a global read sees
        replica 0's only; a resumed run needs all of them to continue exactly.
        Named by the order the weights were first updated (the optimizer's).
        """
        arrays = {}
        for k, var in enumerate(self._averaged):
            counter, global_copy, momentum = self._state[id(var)]
            arrays[f"{k}/counter"] = counter.numpy()
            if global_copy is not None:
                arrays[f"{k}/global"] = global_copy.numpy()
                arrays[f"{k}/delta"] = momentum.numpy()
            for j, v in enumerate(self._copies(var)):
                for i, c in enumerate(v.values):
                    arrays[f"{k}/{j}/{i}"] = c.numpy()
        return arrays

    def restore_state(self, arrays: dict) -> None:
        """Restores `state_arrays()`; weights not updated yet get theirs when first updated."""
        by_weight = {}
        for name, value in arrays.items():
            k, rest = name.split("/", 1)
            by_weight.setdefault(int(k), {})[rest] = value
        self._pending = {}
        for k, values_k in by_weight.items():
            if k < len(self._averaged):
                self._restore(k, values_k)
            else:
                self._pending[k] = values_k

    def _restore(self, k, arrays):
        var = self._averaged[k]
        counter, global_copy, momentum = self._state[id(var)]
        assignments = [(counter, arrays["counter"])]
        if global_copy is not None:
            assignments += [(global_copy, arrays["global"]), (momentum, arrays["delta"])]
        for j, v in enumerate(self._copies(var)):
            assignments += [(c, arrays[f"{j}/{i}"]) for i, c in enumerate(v.values)]
        with tf.init_scope():
            for target, value in assignments:
                if tuple(target.shape) != tuple(value.shape):
                    raise ValueError(
                        f"Averaging state {k} of the checkpoint has shape {value.shape} for "
                        f"{target.name!r} of shape {tuple(target.shape)}: it was saved from "
                        f"another model or optimizer.")
                target.assign(value)

    def _mean(self, var):
        n = len(self._devices)
        group = tuple(range(n))
        return [self.engine.all_reduce(v.read_value(), i, group) / n
                for i, v in enumerate(var.values)]

    def _average(self, var, global_copy, momentum):
        means = self._mean(var)
        ops = []
        if self.block_momentum:
            with tf.device(self._devices[0]):
                block_grad = means[0] - global_copy
                delta = momentum.assign(self.block_momentum * momentum + self.block_lr * block_grad)
                new_global = global_copy.assign_add(delta)
                start = new_global + self.block_momentum * delta
            means = [start] * len(means)
        for i, (v, m) in enumerate(zip(var.values, means)):
            with tf.device(self._devices[i]):
                ops.append(v.assign(tf.identity(m)))
        if self.average_slots:
            for slot in self._slots.get(id(var), []):
                for i, (v, m) in enumerate(zip(slot.values, self._mean(slot))):
                    with tf.device(self._devices[i]):
                        ops.append(v.assign(m))
        with tf.control_dependencies(ops):
            return tf.constant(True)
