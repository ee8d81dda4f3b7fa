"""`strategy.reduce` as Keras 3 calls it, under every tfdist strategy.

A workaround for keras#20585 (Keras 3 `fit` under MultiWorkerMirroredStrategy)
and for first batches the replicas hold unevenly (a batch size the replica
count does not divide), used by `tfdist.MultiWorkerStrategy` and by every mesh
strategy (`MeshStrategy.reduce`, `HorovodStrategy.reduce`).

Private TF API used: none (public `tf.distribute` calls on the strategy).

Keras 3 (trainer.py, `_maybe_symbolic_build`) calls
`strategy.reduce("MEAN", batch, axis=None)` with the *nested* first batch
(a tuple of per-replica tensors, integer labels included) only to learn the
shapes for its symbolic build. `MultiWorkerMirroredStrategy` cannot reduce a
nest ("Attempt to convert a value (PerReplica ...) to a Tensor"), and an
all-reduce across workers of integer labels would be wrong anyway; replicas
of uneven rows cannot be averaged at all ("Inputs to operation AddN must have
the same size and shape"). For that call we return each input's local value,
which has exactly the shapes Keras needs.

Its step functions then call `strategy.reduce("MEAN", value, axis=0)` on
every logged value (`reduce_per_replica`), including scalars (loss, metric
results), where axis 0 does not exist ("Invalid reduction dimension 0 for
input with 0 dimensions"). For a scalar the mean over replicas is meant, so
we reduce it with `axis=None`. Every other `reduce` goes to TensorFlow
unchanged.
"""

import tensorflow as tf


def _is_nest_of_distributed(value) -> bool:
    if isinstance(value, tf.distribute.DistributedValues):
        return False
    leaves = tf.nest.flatten(value)
    return len(leaves) > 0 and all(isinstance(v, tf.distribute.DistributedValues) for v in leaves)


def reduce_for_keras(reduce, strategy, reduce_op, value, axis):
    """`strategy.reduce` with the Keras 3 symbolic-build call answered locally."""
    if axis is None and _is_nest_of_distributed(value):
        return tf.nest.map_structure(lambda v: strategy.experimental_local_results(v)[0], value)
    if axis == 0 and _rank(strategy, value) == 0:
        axis = None
    return reduce(reduce_op, value, axis)


def _rank(strategy, value):
    local = strategy.experimental_local_results(value)[0] if isinstance(
        value, tf.distribute.DistributedValues) else value
    return getattr(getattr(local, "shape", None), "rank", None)
