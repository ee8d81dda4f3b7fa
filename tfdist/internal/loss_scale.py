"""Mixed-precision loss scaling: a step is skipped on every replica when any overflowed.

Private Keras API used here (and only here):
`keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.check_finite`.

Keras's `LossScaleOptimizer` (what `mixed_float16` wraps optimizers in) decides
whether to apply a step from `check_finite(grads)`. Under a strategy with merge
calls it evaluates it on every replica and keeps replica 0's answer, assuming
the gradients were already all-reduced; under tfdist they are each replica's
own (routing happens later, in the inner optimizer), so an overflow on another
replica would be applied and spread NaN through the all-reduce. `install()`
makes the answer global under a tfdist strategy: finite only where every
replica's gradients are finite.
"""

import tensorflow as tf
from keras.src.optimizers import loss_scale_optimizer

from tfdist import collectives, runtime

_KERAS_CHECK_FINITE = loss_scale_optimizer.LossScaleOptimizer.check_finite


def check_finite(self, grads):
    finite = _KERAS_CHECK_FINITE(self, grads)
    if (runtime.current_runtime(self._distribution_strategy) is None
            or tf.distribute.get_replica_context() is None):
        return finite
    overflowed = collectives.sum_over_replicas(tf.cast(tf.logical_not(finite), tf.float32))
    return tf.equal(overflowed, 0.0)


def install() -> None:
    """Makes every LossScaleOptimizer's finite check global under tfdist (idempotent)."""
    loss_scale_optimizer.LossScaleOptimizer.check_finite = check_finite


def installed() -> bool:
    return loss_scale_optimizer.LossScaleOptimizer.check_finite is check_finite
