"""The one seam where gradients meet their variables under a tfdist strategy.

How a gradient reaches its update. Follow the kernel of a row-parallel
`ShardedDense` under `d_ff:model`. The path crosses six tfdist files:

1. `tfdist/layers/dense.py`: the layer reads its kernel.
2. `tfdist/internal/shard_routing.py`: in a replica the read of a
   `ShardedVariable` is the device's component, its shard
   (`ShardedVariable._get`; an FSDP weight is gathered first,
   `tfdist/weight_reads.py`).
3. `tfdist/tensor_parallel.py` (`row`): the contraction on the shard. The
   input is exchanged over the axis.
4. `tfdist/collectives.py`: the named-axis all-to-all and reduce-scatter, and
   their gradients. The ambient mesh's backend is looked up in
   `tfdist/runtime.py`.
5. `tfdist/comm/tf_collectives.py`: the backend's ops, and the fused buckets
   of the gradient reduction.
6. This module, `GradientSeam`. Keras's optimizer hands it the
   `(gradient, variable)` pairs, each replica's own and before any reduction.
   The seam makes one merge call into cross-replica context, and there:
   - routes and reduces: `ShardRouting.reduce_gradients` in file 2 sums each
     gradient over the replicas its variable needs, with file 5's buckets;
   - clips on global norms;
   - makes Keras's accumulation and EMA decisions;
   - runs Keras's weight decay and update step. `ShardRouting._update`
     (file 2) updates each component.
   Back in the replica it applies shard constraints and refreshes ZeRO's kept
   copies.

Three more modules are consulted on the way, for a decision each, without
carrying the gradient: `tfdist/runtime.py` (the ambient mesh),
`tfdist/core/routing.py` (the routing plan, from layouts alone) and
`tfdist/core/zero.py` (ZeRO's groups and slices; a pass-through without ZeRO).
Options add one module each: global clipping (`tfdist/clipping.py`), Lamb's
trust ratio (`keras_lamb`), and loss scaling (`loss_scale`).

Installed at one point: the strategy's variable creator. When a Keras
optimizer creates its first variable (its `iterations`, in its constructor)
under a tfdist `MeshRuntime`, `attach` sets these on that instance:
- `_backend_apply_gradients` (the seam);
- Lamb's `update_step`, from `tfdist.internal.keras_lamb`;
- a `LossScaleOptimizer`'s `check_finite`, from `tfdist.internal.loss_scale`.

No class is patched. An optimizer made elsewhere is Keras's own. The user's
optimizer object keeps its class, config, saving, schedules and `iterations`.
Custom loops take the same seam: `strategy.run(... apply_gradients ...)`, both
in `tf.function` and eagerly (eagerly, `reduce_gradients` sums on each device).

Private Keras API used here (and only here):
- Keras's name-scope stack (`keras_variables.scope_callers`): how the
  optimizer being created is found;
- the `BaseOptimizer` internals Keras's `_backend_apply_gradients` calls:
  `_accumulated_gradients`, `_get_variable_index`,
  `_backend_increment_gradient_accumulators`,
  `_backend_reset_gradient_accumulators`, `_apply_weight_decay`,
  `_backend_update_step`, `_model_variables_moving_average`,
  `_overwrite_model_variables_with_average_value`, `_iterations`,
  `_trainable_variables`, `_distribution_strategy`.
"""

import types

import keras
import tensorflow as tf
from keras.src import ops
from keras.src.optimizers import base_optimizer, lamb, loss_scale_optimizer

from tfdist import runtime, weight_reads
from tfdist.clipping import Clipping
from tfdist.internal import keras_lamb, keras_variables, loss_scale


def optimizer_being_created():
    """The Keras optimizer whose variable is being created now, or None.

    Keras creates an optimizer's variables inside
    `backend.name_scope(optimizer.name, caller=optimizer)`.
    """
    callers = keras_variables.scope_callers()
    caller = callers[-1] if callers else None
    return caller if isinstance(caller, base_optimizer.BaseOptimizer) else None


def attach(optimizer, strategy) -> None:
    """Attaches the seam to `optimizer`, created under `strategy` (a tfdist `MeshRuntime`).

    This is idempotent. Only this instance changes.
    """
    if getattr(optimizer, "_tfdist_seam", None) is not None:
        return
    seam = GradientSeam(optimizer, strategy)
    # `object.__setattr__`: plain attributes, kept out of Keras's and TF's tracking.
    object.__setattr__(optimizer, "_tfdist_seam", seam)
    object.__setattr__(optimizer, "_backend_apply_gradients", seam.apply_gradients)
    if isinstance(optimizer, lamb.Lamb):
        object.__setattr__(optimizer, "update_step",
                           types.MethodType(keras_lamb.update_step, optimizer))
    if isinstance(optimizer, loss_scale_optimizer.LossScaleOptimizer):
        object.__setattr__(optimizer, "check_finite",
                           types.MethodType(loss_scale.check_finite, optimizer))


def seam_of(optimizer):
    """The `GradientSeam` attached to `optimizer`, or None."""
    return getattr(optimizer, "_tfdist_seam", None)


class GradientSeam:
    """Receives one optimizer's `(gradient, variable)` pairs and updates the variables.

    See the module docstring for the route. `apply_gradients` takes the place
    of the optimizer's `_backend_apply_gradients`, and Keras's `apply` calls it.
    It makes Keras's decisions in Keras's order:
    - clipping, weight decay and the update step;
    - or, with `gradient_accumulation_steps`, accumulate or apply the average;
    - then the EMA update and its overwrite.
    Everything that updates a variable runs in cross-replica context. There an
    update of a distributed variable is one op per component, and a cond may
    hold it. (A merge call inside a cond branch is what TF refuses: "merge_call
    called while defining a new graph".)
    """

    def __init__(self, optimizer, strategy):
        self.optimizer = optimizer
        self.strategy = strategy

    def _routed(self) -> bool:
        return (runtime.current_runtime(self.optimizer._distribution_strategy) is not None
                and tf.distribute.get_replica_context() is not None)

    def apply_gradients(self, grads, trainable_variables):
        """The optimizer's `_backend_apply_gradients`, called by Keras's `apply` in a replica."""
        optimizer = self.optimizer
        if not self._routed():  # cross-replica context: Keras's own, the values are global
            return base_optimizer.BaseOptimizer._backend_apply_gradients(
                optimizer, grads, trainable_variables)
        grads, trainable_variables = list(grads), list(trainable_variables)
        _refuse_unsupported(optimizer, [_tf_variable(v) for v in trainable_variables])
        context = tf.distribute.get_replica_context()
        context.merge_call(self._step, args=(grads, trainable_variables))
        if optimizer.use_ema:
            _update_moving_averages(optimizer)
            if optimizer.ema_overwrite_frequency:
                context.merge_call(_maybe_overwrite_with_averages, args=(optimizer,))
        _apply_shard_constraints(optimizer, trainable_variables)
        self.strategy.extended.refresh_kept(trainable_variables)  # ZeRO-1/2's whole copies

    def _step(self, strategy, grads, trainable_variables):
        """In cross-replica context: reduce, then clip, decay and update (or accumulate)."""
        optimizer, extended = self.optimizer, strategy.extended
        present = [k for k, g in enumerate(grads) if g is not None]
        if not present:
            return
        grads = [grads[k] for k in present]
        trainable_variables = [trainable_variables[k] for k in present]
        variables = [_tf_variable(v) for v in trainable_variables]
        clipping = Clipping.of(optimizer)
        if not optimizer.gradient_accumulation_steps:
            reduced = extended.reduce_gradients(list(zip(grads, variables)), clipping)
            with extended.direct_updates(variables):
                optimizer._apply_weight_decay(trainable_variables)
                optimizer._backend_update_step(reduced, trainable_variables,
                                               optimizer.learning_rate)
            return
        # Accumulation: every micro-step reduces (outside the cond, so every replica
        # runs the same collectives every step); the sum over micro-steps of
        # global-batch gradients is one device's accumulated gradient.
        reduced = extended.reduce_gradients(list(zip(grads, variables)))
        steps = optimizer.gradient_accumulation_steps
        accumulators = [optimizer._accumulated_gradients[optimizer._get_variable_index(v)]
                        for v in trainable_variables]
        is_update_step = (optimizer._iterations + 1) % steps == 0

        def apply():
            with extended.direct_updates(variables):
                averaged = [extended.map_components(
                    lambda g, acc: (tf.convert_to_tensor(g) + acc) / steps, g, acc.value, like=v)
                    for g, acc, v in zip(reduced, accumulators, variables)]
                averaged = extended.clip(clipping, averaged, variables)
                optimizer._apply_weight_decay(trainable_variables)
                optimizer._backend_update_step(averaged, trainable_variables,
                                               optimizer.learning_rate)
                optimizer._backend_reset_gradient_accumulators()

        def accumulate():
            with extended.direct_updates(variables):
                optimizer._backend_increment_gradient_accumulators(reduced, accumulators)

        ops.cond(is_update_step, apply, accumulate)


def _tf_variable(variable):
    return variable.value if isinstance(variable, keras.Variable) else variable


def _refuse_unsupported(optimizer, variables) -> None:
    """One clear error for the options tfdist cannot yet train exactly, before any step runs."""
    strategy = optimizer._distribution_strategy
    sharded = [v.name for v in variables if getattr(v, "layout", None) is not None]
    if type(optimizer).__name__ == "Adafactor" and sharded:
        raise ValueError(
            f"Adafactor is not supported for sharded weights under {strategy!r}: it "
            f"factors the second moments over each whole weight, and a replica holds a "
            f"shard (sharded weights {sharded[:3]}). Use it on a mesh whose layout shards "
            f"no weight, or another optimizer (Adam, AdamW, Lamb, Lion, SGD... train "
            f"exactly).")


def _apply_shard_constraints(optimizer, trainable_variables):
    """Constraints of sharded weights (`tfdist.layers.weights`), applied to each replica's shard.

    Keras applies a variable's constraint with `keras.Variable.assign`, which
    checks the global shape. tfdist keeps sharded weights' constraints away from
    Keras and assigns them here, to the shard, where they are exact.
    """
    for variable in trainable_variables:
        constraint = getattr(variable, "_tfdist_constraint", None)
        if constraint is not None:
            optimizer.assign(variable, constraint(variable))


def _update_moving_averages(optimizer):
    """Keras's `_update_model_variables_moving_average`, assigning each replica's components.

    Keras assigns through `keras.Variable.assign`, which checks the value against
    the weight's global shape. In a replica a sharded weight's average is a
    shard, and so is the weight read here. (A `LayoutMap` weight would
    otherwise be read gathered whole, `tfdist.weight_reads`.)
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
