"""Keras's conditional optimizer updates under a tfdist mesh: accumulation and EMA.

Private Keras API used here (and only here): `TFOptimizer._backend_apply_gradients`
(replaced, Keras's own kept for every other strategy) and the optimizer
internals it calls: `_accumulated_gradients`, `_get_variable_index`,
`_backend_increment_gradient_accumulators`, `_backend_reset_gradient_accumulators`,
`_apply_weight_decay`, `_backend_update_step`, `_model_variables_moving_average`,
`_overwrite_model_variables_with_average_value`.

It also applies the constraints of sharded weights, which tfdist keeps from
Keras (`tfdist.layers.weights.add_sharded_weight`), to each shard.

Keras applies `gradient_accumulation_steps` and `ema_overwrite_frequency`
inside `ops.cond`, in each replica. A TF strategy updates a variable from a
replica through a merge call, and a merge call cannot run inside a cond branch
(TF refuses: "merge_call called while defining a new graph"). Under a tfdist
mesh, `install()` makes the same decisions, in Keras's order, in
cross-replica context, where updating a distributed variable is a plain op on
each of its components and a cond may hold them:

- accumulation: one merge call per (micro-)step reduces the gradients
  (`ShardRouting.reduce_gradients`, outside any cond: every replica runs the
  same collectives every step), then runs the cond: accumulate the reduced
  gradients, or apply `(g + accumulated) / steps` clipped on global norms
  (`ShardRouting.clip`), with Keras's weight decay and update step, and reset
  the accumulators. The sum over micro-steps of global-batch gradients is one
  device's accumulated gradient, so training is one device's. (It all-reduces
  every micro-step: exact, but no communication saving.)
- moving averages: each replica updates its components' averages itself
  (through the optimizer's `assign`, as Keras's update steps do: a sharded
  weight's average is a shard); the overwrite cond runs in one merge call.

While such a cross-replica update runs, the strategy reports that it needs no
merge call (`ShardRouting.direct_updates`), so Keras's
`maybe_merge_call(fn, strategy)` helpers call `fn` directly.
"""

import tensorflow as tf
from keras.src import ops
from keras.src.backend.tensorflow import optimizer as tf_optimizer

from tfdist import runtime, weight_reads
from tfdist.clipping import Clipping
from tfdist.internal import mesh_extended
from tfdist.internal.optimizer_gradients import _routed

_KERAS_APPLY = tf_optimizer.TFOptimizer._backend_apply_gradients


def _backend_apply_gradients(self, grads, trainable_variables):
    if not _routed(self):
        return _KERAS_APPLY(self, grads, trainable_variables)
    if not (self.gradient_accumulation_steps or self.use_ema):
        _KERAS_APPLY(self, grads, trainable_variables)
    else:
        _apply_in_cross_replica_context(self, grads, trainable_variables)
    _apply_shard_constraints(self, trainable_variables)
    mesh_extended.refresh_kept_in_replica(trainable_variables)  # ZeRO-1/2's whole copies


def _apply_shard_constraints(optimizer, trainable_variables):
    """Constraints of sharded weights (`tfdist.layers.weights`), applied to each replica's shard.

    Keras applies a variable's constraint with `keras.Variable.assign`, which
    checks the global shape; tfdist keeps sharded weights' constraints from
    Keras and assigns them here, to the shard, where they are exact.
    """
    for variable in trainable_variables:
        constraint = getattr(variable, "_tfdist_constraint", None)
        if constraint is not None:
            optimizer.assign(variable, constraint(variable))


def _apply_in_cross_replica_context(self, grads, trainable_variables):
    context = tf.distribute.get_replica_context()
    if self.gradient_accumulation_steps:
        context.merge_call(_accumulate_or_apply, args=(self, list(grads), list(trainable_variables)))
    else:
        grads = self._clip_gradients(grads)  # deferred: clipped after the reduction
        self._apply_weight_decay(trainable_variables)
        self._backend_update_step(grads, trainable_variables, self.learning_rate)
    if self.use_ema:
        _update_moving_averages(self)
        if self.ema_overwrite_frequency:
            context.merge_call(_maybe_overwrite_with_averages, args=(self,))


def _accumulate_or_apply(strategy, optimizer, grads, trainable_variables):
    """Keras's accumulation step, in cross-replica context (see the module docstring)."""
    extended = strategy.extended
    variables = [v.value for v in trainable_variables]
    present = [k for k, g in enumerate(grads) if g is not None]
    reduced = extended.reduce_gradients([(grads[k], variables[k]) for k in present])
    variables = [variables[k] for k in present]
    trainable_variables = [trainable_variables[k] for k in present]
    steps = optimizer.gradient_accumulation_steps
    accumulators = [optimizer._accumulated_gradients[optimizer._get_variable_index(v)]
                    for v in trainable_variables]
    is_update_step = (optimizer._iterations + 1) % steps == 0

    def apply():
        with extended.direct_updates(variables):
            averaged = [extended.map_components(
                lambda g, acc: (tf.convert_to_tensor(g) + acc) / steps, g, acc.value, like=v)
                for g, acc, v in zip(reduced, accumulators, variables)]
            averaged = extended.clip(Clipping.of(optimizer), averaged, variables)
            optimizer._apply_weight_decay(trainable_variables)
            optimizer._backend_update_step(averaged, trainable_variables, optimizer.learning_rate)
            optimizer._backend_reset_gradient_accumulators()

    def accumulate():
        with extended.direct_updates(variables):
            optimizer._backend_increment_gradient_accumulators(reduced, accumulators)

    ops.cond(is_update_step, apply, accumulate)


def _update_moving_averages(optimizer):
    """Keras's `_update_model_variables_moving_average`, assigning each replica's components.

    Keras assigns through `keras.Variable.assign`, which checks the value against
    the weight's global shape; in a replica a sharded weight's average is a shard,
    and so is the weight read here (a `LayoutMap` weight would otherwise read
    gathered whole, `tfdist.weight_reads`).
    """
    with weight_reads.local_axes(*runtime.current_mesh().shape.names):
        for var, average in zip(optimizer._trainable_variables,
                                optimizer._model_variables_moving_average):
            if average is not None:
                not_first_step = ops.not_equal(optimizer.iterations, 0)
                momentum = ops.multiply(ops.cast(not_first_step, var.dtype),
                                        optimizer.ema_momentum)
                optimizer.assign(average, ops.add(ops.multiply(momentum, average),
                                                  ops.multiply(ops.subtract(1, momentum), var)))


def _maybe_overwrite_with_averages(strategy, optimizer):
    should_overwrite = (optimizer.iterations + 1) % optimizer.ema_overwrite_frequency == 0
    variables = [v.value for v in optimizer._trainable_variables]

    def overwrite():
        with strategy.extended.direct_updates(variables):
            optimizer._overwrite_model_variables_with_average_value(optimizer._trainable_variables)

    ops.cond(should_overwrite, overwrite, lambda: None)


def install() -> None:
    """Runs Keras's conditional updates in cross-replica context under tfdist (idempotent)."""
    tf_optimizer.TFOptimizer._backend_apply_gradients = _backend_apply_gradients


def installed() -> bool:
    return tf_optimizer.TFOptimizer._backend_apply_gradients is _backend_apply_gradients
