"""Lamb on sharded weights: its trust ratio from the norms of the whole weight.

Private Keras API mirrored here (and only here): `keras.src.optimizers.lamb.Lamb.update_step`.

Lamb scales each weight's update by `||w|| / ||update||`, norms of the whole
weight. Under a tfdist mesh an update sees one shard, whose norms are not the
weight's. `update_step` is Keras's own formula in which, for a sharded weight
only, the two squared norms are summed over the shards
(`ShardRouting.global_sum_of_squares`, one all-reduce each). The gradient seam
sets it on each Lamb created under a tfdist strategy
(`tfdist.internal.gradient_seam.attach`); no class is patched. Replicated
weights run Keras's method unchanged.
"""

from keras.src import ops
from keras.src.optimizers import lamb

from tfdist import runtime
from tfdist.mesh import TensorLayout


def _sharded_container(variable):
    """The sharded distributed variable `variable` is a component of, or None."""
    # Where TF links a component to its distributed variable (as Keras's `_var_key` looks).
    container = getattr(variable, "_distributed_container", None)
    if container is None:
        container = getattr(getattr(variable, "handle", None), "_distributed_container", None)
    container = container() if callable(container) else None
    return container if isinstance(getattr(container, "layout", None), TensorLayout) else None


def update_step(self, gradient, variable, learning_rate):
    """`Lamb.update_step` of optimizer `self`, with the norms of whole sharded weights."""
    sharded = _sharded_container(variable)
    if sharded is None or runtime.current_runtime(self._distribution_strategy) is None:
        return lamb.Lamb.update_step(self, gradient, variable, learning_rate)
    extended = self._distribution_strategy.extended
    # Keras's Lamb.update_step, with the norms of the global weight.
    lr = ops.cast(learning_rate, variable.dtype)
    gradient = ops.cast(gradient, variable.dtype)
    local_step = ops.cast(self.iterations + 1, variable.dtype)
    beta_1_power = ops.power(ops.cast(self.beta_1, variable.dtype), local_step)
    beta_2_power = ops.power(ops.cast(self.beta_2, variable.dtype), local_step)
    m = self._momentums[self._get_variable_index(variable)]
    v = self._velocities[self._get_variable_index(variable)]
    self.assign_add(m, ops.multiply(ops.subtract(gradient, m), 1 - self.beta_1))
    self.assign_add(v, ops.multiply(ops.subtract(ops.square(gradient), v), 1 - self.beta_2))
    m_t_hat = ops.divide(m, (1.0 - beta_1_power))
    v_sqrt = ops.add(ops.sqrt(ops.divide(v, (1.0 - beta_2_power))), self.epsilon)
    update = ops.divide(m_t_hat, v_sqrt)
    w_norm = ops.sqrt(extended.global_sum_of_squares(ops.convert_to_tensor(variable), sharded))
    g_norm = ops.sqrt(extended.global_sum_of_squares(update, sharded))
    ratio = ops.where(
        ops.greater(w_norm, 0),
        ops.where(ops.greater(g_norm, 0), (w_norm / g_norm), 1.0),
        1.0,
    )
    self.assign_sub(variable, ratio * lr * update)

