"""MultiWorkerStrategy: tf.distribute's multi-worker data parallelism, usable from Keras 3."""

from typing import Optional

import tensorflow as tf

from tfdist.cluster import ClusterConfig
from tfdist.internal import hooks, install_keras_hooks
from tfdist.internal.even_steps import wrap_mirrored_steps
from tfdist.internal.keras_reduce import reduce_for_keras

_IMPLEMENTATIONS = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}


class MultiWorkerStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """`MultiWorkerMirroredStrategy` under which Keras 3 `fit`/`evaluate`/`predict` work.

    Every task of the TF_CONFIG cluster runs the same program (between-graph
    data parallelism); gradients are all-reduced with RING or NCCL
    collectives. Keras 3 calls `strategy.reduce` in two ways that
    `MultiWorkerMirroredStrategy` rejects (keras#20585); this strategy
    answers them (`tfdist.internal.keras_reduce`) and leaves every
    other call to TensorFlow. A partial batch (rows the replicas hold
    unevenly, or none) trains and evaluates as on one device: Keras's losses
    and metrics count the real rows of every replica (`tfdist.batch_rows`).
    TF_CONFIG is checked first (`tfdist.cluster.ClusterConfig`),
    so a broken one fails with one clear message.

    Args:
        communication: "ring" (CPU/GPU), "nccl" (GPU) or "auto".
        timeout_seconds: a collective waiting this long for a peer fails
            instead of hanging (0: wait forever).
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`
            (default: from TF_CONFIG).
    """

    def __init__(self, communication: str = "ring", timeout_seconds: float = 60.0,
                 cluster_resolver: Optional[object] = None):
        hooks.verify()  # the installed TF / Keras / keras-hub are the ones tfdist hooks into
        if communication not in _IMPLEMENTATIONS:
            raise ValueError(f"communication must be one of {sorted(_IMPLEMENTATIONS)}; "
                             f"received communication={communication!r}.")
        if cluster_resolver is None:
            ClusterConfig.from_env()  # raises one clear error for a broken TF_CONFIG
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=_IMPLEMENTATIONS[communication],
            timeout_seconds=timeout_seconds or None)
        super().__init__(cluster_resolver=cluster_resolver, communication_options=options)
        install_keras_hooks()
        wrap_mirrored_steps(self.extended)

    def reduce(self, reduce_op, value, axis):
        return reduce_for_keras(super().reduce, self, reduce_op, value, axis)
