"""Mixed-precision loss scaling: a step is skipped on every replica when any overflowed.

Private Keras API used here (and only here):
`keras.src.optimizers.loss_scale_optimizer.LossScaleOptimizer.check_finite`, which
Keras's `_tf_apply` calls on every replica.

Keras's `LossScaleOptimizer` (what `mixed_float16` wraps optimizers in) decides
whether to apply a step from `check_finite(grads)`. Under a strategy with merge
calls it evaluates it on every replica and keeps replica 0's answer, assuming
the gradients were already all-reduced; under tfdist they are each replica's
own (routing happens later, in the inner optimizer), so an overflow on another
replica would be applied and spread NaN through the all-reduce. `check_finite`
makes the answer global: finite only where every replica's gradients are
finite. The gradient seam sets it on each `LossScaleOptimizer` created under a
tfdist strategy (`tfdist.internal.gradient_seam.attach`); no class is patched.
"""

import tensorflow as tf
from keras.src.optimizers import loss_scale_optimizer

from tfdist import collectives, runtime

def check_finite(self, grads):
    """`LossScaleOptimizer.check_finite` of `self`, over every replica's gradients."""
    finite = loss_scale_optimizer.LossScaleOptimizer.check_finite(self, grads)
    if (runtime.current_runtime(self._distribution_strategy) is None
            or tf.distribute.get_replica_context() is None):
        return finite
    overflowed = collectives.sum_over_replicas(tf.cast(tf.logical_not(finite), tf.float32))
    return tf.equal(overflowed, 0.0)

