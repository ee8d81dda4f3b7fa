"""Recomputation that trains exactly like no recomputation: `keras.remat` and `keras.RematScope` on TF.

Private TF/Keras API used here (and only here):
`keras.src.backend.tensorflow.core.remat` (what `keras.remat`, `keras.RematScope`
and every layer built under one call), Keras's global state entries
`"current_call_ctx"` and `"autocast_scope"` (the `training` value and the
mixed-precision casts a layer's call runs under), `StatelessScope.add_update` /
`get_current_value`, `keras.layers.Layer.add_loss` (wrapped), and
`tensorflow.python.eager.record.stop_recording`.

Keras 3.15's TF backend recomputes with `tf.recompute_grad(f)`, which re-runs
`f` in the backward pass as if nothing had happened in between. Measured here
(`tests/internal/test_keras_remat.py` shows each against Keras's own remat):

1. The recomputation draws other random numbers: every dropout has advanced
   its seed generator in the forward pass, so the backward pass differentiates
   other masks than the ones the loss saw. Gradients are silently wrong, and
   each seed generator (and BatchNormalization statistic, and metric updated
   inside) is updated twice per step.
2. The forward pass runs with the tape stopped, so a loss a layer adds with
   `add_loss` (an MoE's balancing loss, an activity regulariser) is
   constant to the optimizer: its gradient is silently dropped.
3. The recomputation runs outside the Keras call that made it: a sublayer that
   takes `training` from the call context sees `None` (its dropout is off) and
   mixed-precision autocasting is gone, so it recomputes other values.
4. Under `tf.function` (every `fit`) a layer built under `RematScope` fails:
   Keras passes `training=` by keyword and graph-mode `tf.custom_gradient` takes
   no keyword arguments.

`remat(f)` here fixes all four: the forward pass runs `f` in a
`keras.StatelessScope` that records every variable update instead of doing it,
applies the updates once afterwards, and keeps each updated variable's
previous value; the recomputation runs `f` with those previous values
(so the same seeds, statistics and counters), with every update discarded,
under the Keras call context and autocast scope of the forward pass. Losses
added inside `f` become outputs of the recomputed function, so they carry
their gradient; they are added back to their layers. Tensor arguments travel
positionally (floating tensors are differentiated, others are constants) and
keyword arguments are bound in a closure.

The gradients of one recomputed call are released together (`_released_together`): a
strategy that updates each variable as soon as its gradient exists (model averaging)
would otherwise be free to overwrite a variable before the recomputation has read it
for another variable's gradient.

Collectives inside `f` run again in the recomputation, in the same order on
every replica; the recomputation waits for the output's gradient (a data
dependency, as `tf.recompute_grad` does), so it is not scheduled with the
forward pass.
"""

import functools
import threading

import keras
import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import StatelessScope, get_stateless_scope
from keras.src.backend.common.symbolic_scope import in_symbolic_scope
from keras.src.backend.tensorflow import core as tf_core
from tensorflow.python.eager import record

from tfdist import runtime
from tfdist.internal import keras_variables

_KERAS_REMAT = tf_core.remat
_KERAS_ADD_LOSS = keras.layers.Layer.add_loss
# Keras's ambient state a layer's call depends on: `training` and autocasting.
_CONTEXT_KEYS = ("current_call_ctx", "autocast_scope")
_local = threading.local()  # .losses: the (layer, loss) pairs of the innermost recorded call


class _RecordingScope(StatelessScope):
    """A StatelessScope that remembers which variables were updated (Keras keeps only ids).

    Reads fall back to `parent`'s values, so a recomputed function nested in
    another stateless call (an outer remat) sees the updates made before it.
    """

    def __init__(self, state_mapping=(), parent=None):
        super().__init__(list(state_mapping), collect_losses=False, initialize_variables=False)
        self.parent = parent
        self.updated = {}

    def add_update(self, update):
        self.updated.setdefault(id(update[0]), update[0])
        super().add_update(update)

    def get_current_value(self, variable):
        value = super().get_current_value(variable)
        if value is None and self.parent is not None:
            value = self.parent.get_current_value(variable)
        return value


def _add_loss(self, loss):
    """`Layer.add_loss`, recorded instead while a recomputed function runs."""
    losses = getattr(_local, "losses", None)
    if losses is None:
        return _KERAS_ADD_LOSS(self, loss)
    for x in tf.nest.flatten(loss):
        if not tf.is_tensor(x):
            return _KERAS_ADD_LOSS(self, loss)  # Keras's own error
        losses.append((self, x))


class _Call:
    """The context one recomputed call runs `f` in: Keras's ambient state and a loss recorder."""

    def __init__(self, context, scope):
        self.context, self.scope = context, scope

    def __enter__(self):
        self.saved = {key: global_state.get_global_attribute(key) for key in self.context}
        for key, value in self.context.items():
            global_state.set_global_attribute(key, value)
        self.saved_losses = getattr(_local, "losses", None)
        _local.losses = self.losses = []
        self.scope.__enter__()
        return self

    def __exit__(self, *exc):
        self.scope.__exit__(*exc)
        _local.losses = self.saved_losses
        for key, value in self.saved.items():
            global_state.set_global_attribute(key, value)


def _differentiable(value) -> bool:
    """Dense floating tensors are differentiated; anything else is a constant of the call."""
    return isinstance(value, tf.Tensor) and value.dtype.is_floating


def _after(tensor, gradient):
    """`tensor`, made to depend on `gradient` (XLA ignores control dependencies)."""
    first = tf.reduce_max(tf.reshape(gradient, [-1])[:1])
    finite = tf.cast(first, tf.bool)
    return tensor + tf.cast(tf.where(tf.equal(finite, finite), 0.0, float("nan")), tensor.dtype)


def _released_together(gradients):
    """`gradients`, none of which is available before all of them are.

    The recomputation reads the variables again; a variable's own gradient may not need
    its read (a last Dense layer's kernel gradient needs only its input), while an
    earlier layer's does. A strategy that updates each variable as soon as its gradient
    exists (model averaging: no all-reduce joins the gradients) could then overwrite the
    variable before the recomputation has read it for the earlier layer, and TF did not
    order the two: the earlier layer's gradient saw the updated value in some runs.
    """
    ready = [g.values if isinstance(g, tf.IndexedSlices) else g
             for g in gradients if g is not None]
    if not ready or tf.executing_eagerly():
        return gradients
    with tf.control_dependencies(ready):
        return [g if g is None else
                tf.IndexedSlices(tf.identity(g.values), g.indices, g.dense_shape)
                if isinstance(g, tf.IndexedSlices) else tf.identity(g) for g in gradients]


def _refuse_split_weights(layer):
    """Raises if `layer`, recomputed in a mesh replica, has a weight a `LayoutMap` splits.

    The recomputation's variable gradients bypass the sharded weight reads of
    `keras_tensor_parallel` and `weight_reads` (a shard's gradient reaches the
    reduce-scatter meant for the gathered weight), so such a layer cannot be
    recomputed yet; tfdist's own layers can (`tfdist.remat`).
    """
    if (not isinstance(layer, keras.layers.Layer) or runtime.current_runtime() is None
            or tf.distribute.in_cross_replica_context()):
        return
    for weight in layer.weights:
        layout = keras_variables.layout_of(weight)
        if (layout is not None and layout.sharded_mesh_axes
                and not keras_variables.keeps_whole(weight)):
            raise NotImplementedError(
                f"tfdist: layer {layer.name!r} is recomputed (keras.RematScope or keras.remat) "
                f"and its weight {weight.path!r} is split by the LayoutMap over mesh axes "
                f"{layout.sharded_mesh_axes}; recomputing a Keras layer whose weights a "
                "LayoutMap splits is not supported. Build it outside RematScope, or leave "
                "its weights whole in the LayoutMap.")


def remat(f):
    """`f`, recomputed in the backward pass instead of keeping its activations.

    Trains exactly like `f` itself: the same random numbers, one update of
    each variable `f` assigns, gradients for the losses `f` adds (module doc).

    Args:
        f: a function or a layer's bound `call`; positional and keyword
            arguments may hold tensors anywhere in nested structures.

    Returns:
        A function with `f`'s signature and outputs.
    """

    keras.layers.Layer.add_loss = _add_loss  # losses inside `f` are recorded

    @functools.wraps(f)
    def recomputed(*args, **kwargs):
        if in_symbolic_scope():  # shape inference: nothing to differentiate
            return f(*args, **kwargs)
        _refuse_split_weights(getattr(f, "__self__", None))
        flat = tf.nest.flatten((args, kwargs))
        where = [i for i, value in enumerate(flat) if _differentiable(value)]
        context = {key: global_state.get_global_attribute(key) for key in _CONTEXT_KEYS}
        outer = get_stateless_scope()
        forward = {}

        def call(inputs, scope):
            values = list(flat)
            for i, tensor in zip(where, inputs):
                values[i] = tensor
            a, kw = tf.nest.pack_sequence_as((args, kwargs), values)
            with _Call(context, scope) as run:
                outputs = f(*a, **kw)
            return outputs, run.losses

        @tf.custom_gradient
        def checkpointed(*inputs):
            scope = _RecordingScope(parent=outer)
            with record.stop_recording():
                outputs, losses = call(inputs, scope)
                # Each updated variable's value before this call, then the update, once.
                previous = [(v, tf.identity(v.value)) for v in scope.updated.values()]
                for variable, _ in previous:
                    variable.assign(scope.get_current_value(variable))
            forward.update(structure=outputs, layers=[layer for layer, _ in losses])
            flat_out = tf.nest.flatten(outputs) + [loss for _, loss in losses]

            def gradient(*grads, variables=None):
                grads = [tf.zeros_like(y) if g is None else g for g, y in zip(grads, flat_out)]
                with tf.GradientTape() as tape:
                    again = [tf.identity(x) for x in inputs]
                    if not tf.executing_eagerly():
                        again = [_after(x, grads[0]) for x in again]
                    tape.watch(again)
                    if variables:
                        tape.watch(variables)
                    outputs, losses = call(again, _RecordingScope(previous, parent=outer))
                    ys = tf.nest.flatten(outputs) + [loss for _, loss in losses]
                if len(ys) != len(flat_out):
                    raise RuntimeError(
                        f"The recomputation of {getattr(f, '__qualname__', f)} returned "
                        f"{len(ys)} outputs and losses where the forward pass returned "
                        f"{len(flat_out)}; a recomputed function must add the same losses "
                        "every time it runs.")
                pairs = [(y, g) for y, g in zip(ys, grads) if y.dtype.is_floating]
                sources = list(again) + list(variables or [])
                dx = tape.gradient([y for y, _ in pairs], sources,
                                   output_gradients=[g for _, g in pairs],
                                   unconnected_gradients=tf.UnconnectedGradients.ZERO)
                dx = _released_together(dx)
                return dx[:len(again)], dx[len(again):]

            return flat_out, gradient

        flat_out = checkpointed(*[flat[i] for i in where])
        count = len(tf.nest.flatten(forward["structure"]))
        outputs = tf.nest.pack_sequence_as(forward["structure"], list(flat_out[:count]))
        for layer, loss in zip(forward["layers"], flat_out[count:]):
            layer.add_loss(loss)
        return outputs

    return recomputed


def install() -> None:
    """Makes `keras.remat`, `keras.RematScope` and layers built under one use `remat` (idempotent)."""
    tf_core.remat = remat
    keras.layers.Layer.add_loss = _add_loss


def installed() -> bool:
    return tf_core.remat is remat and keras.layers.Layer.add_loss is _add_loss
