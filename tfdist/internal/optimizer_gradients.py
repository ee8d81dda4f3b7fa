"""The optimizer hook where tfdist routes gradients by variable.

Private Keras API used here (and only here):
`keras.src.backend.tensorflow.optimizer.TFOptimizer._all_reduce_sum_gradients`
and `BaseOptimizer._clip_gradients` (through `TFOptimizer`).

Keras 3's TF optimizer pairs each gradient with its variable only inside the
optimizer: `BaseOptimizer.apply` unscales (loss scaling), then
`_backend_apply_gradients` clips and applies weight decay, then
`TFOptimizer._backend_update_step` calls
`_all_reduce_sum_gradients(grads_and_vars)`, which hands the *values* alone
to `replica_context.all_reduce(SUM, grads)`, and finally applies the reduced
gradients with `strategy.extended.update(var, ...)`. A strategy sees the
variables first in that update, after the reduction, too late to reduce a
sharded weight's gradient over only the replicas holding its shard.

`install()` replaces `_all_reduce_sum_gradients` on the class: under a
strategy that is a `tfdist.runtime.MeshRuntime`, the `(gradient, variable)`
pairs go in one merge call to `strategy.extended.reduce_gradients`, which
routes each gradient by its variable (`tfdist.internal.mesh_extended`);
under every other strategy Keras's own method runs unchanged. The user's
model, optimizer and `fit` are untouched.

Keras clips (`clipnorm`, `global_clipnorm`, `clipvalue`) in
`_backend_apply_gradients`, per replica and before any reduction. Under a
tfdist strategy `_clip_gradients` passes the replica's gradients through and
the clipping is applied to the reduced gradients instead (`tfdist.clipping`),
so it clips the global gradient as one device would.
"""

from keras.src.backend.tensorflow import optimizer as tf_optimizer

from tfdist import runtime
from tfdist.clipping import Clipping

_KERAS_ALL_REDUCE = tf_optimizer.TFOptimizer._all_reduce_sum_gradients
_KERAS_CLIP = tf_optimizer.TFOptimizer._clip_gradients


def _routed(optimizer) -> bool:
    import tensorflow as tf

    return (runtime.current_runtime(optimizer._distribution_strategy) is not None
            and tf.distribute.get_replica_context() is not None)


def _clip_gradients(self, grads):
    if _routed(self):
        return grads  # clipped after the reduction, in `_all_reduce_sum_gradients`
    return _KERAS_CLIP(self, grads)


def _all_reduce_sum_gradients(self, grads_and_vars):
    import tensorflow as tf

    if not _routed(self):
        return _KERAS_ALL_REDUCE(self, grads_and_vars)
    grads_and_vars = list(grads_and_vars)
    _refuse_unsupported(self, [v for _, v in grads_and_vars])
    present = [(g, v) for g, v in grads_and_vars if g is not None]
    if not present:
        return grads_and_vars
    clipping = Clipping.of(self)
    reduced = iter(tf.distribute.get_replica_context().merge_call(
        lambda s, pairs: s.extended.reduce_gradients(pairs, clipping), args=(present,)))
    return [(g if g is None else next(reduced), v) for g, v in grads_and_vars]


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


def install() -> None:
    """Routes Keras TF optimizers' gradients through tfdist strategies (idempotent)."""
    tf_optimizer.TFOptimizer._all_reduce_sum_gradients = _all_reduce_sum_gradients
    tf_optimizer.TFOptimizer._clip_gradients = _clip_gradients


def installed() -> bool:
    return (tf_optimizer.TFOptimizer._all_reduce_sum_gradients is _all_reduce_sum_gradients
            and tf_optimizer.TFOptimizer._clip_gradients is _clip_gradients)
