"""ModelAveragingStrategy: local SGD, weights averaged every K steps (optionally BMUF)."""

import math
from typing import Optional, Sequence

import keras
import tensorflow as tf

from tfdist.comm.tf_collectives import TFCollectiveBackend
from tfdist.internal import hooks, install_keras_hooks
from tfdist.internal.model_averaging import AveragingExtended
from tfdist.mesh import Mesh
from tfdist.strategies.mesh_strategy import resolve_devices


class ModelAveragingStrategy(tf.distribute.Strategy):
    """Data parallelism that communicates weights every `period` steps, not gradients.

    Each replica trains its own copy of the model on its part of every global
    batch (its gradient is that of its own mean loss); every `period` optimizer
    steps the copies are averaged over all replicas (model averaging, Su &
    Chen 2015; local SGD). With `block_momentum` the average becomes a block
    update with momentum (BMUF). `period=1` with SGD is synchronous SGD.

    Between averagings the replicas differ: `get_weights`, saving and
    `evaluate` see replica 0's copy. Call `average_now()` (or end training on
    a multiple of `period`) before saving to get the averaged model. tfdist's
    checkpoints (`BackupAndRestore`) also hold every replica's copy, the
    counters and the BMUF state, so a resumed run continues exactly.

    Args:
        period: K, optimizer steps between averagings.
        num_replicas: replicas when `devices` is not given (default: all
            logical GPUs, else 1 CPU).
        devices: one device name per replica (may span tasks of a cluster).
        average_slots: also average the optimizer's slots (e.g. Adam moments).
        block_momentum: BMUF block momentum mu in [0, 1); 0 = plain averaging.
        block_lr: BMUF block learning rate zeta.

    Example:

    ```python
    strategy = ModelAveragingStrategy(period=4, num_replicas=4)
    with strategy.scope():
        model = make_model()
        model.compile("sgd", "mse")
    model.fit(x, y, batch_size=64, callbacks=[CommunicationBytes(strategy)])
    ```
    """

    _collective_key_base = 70000

    def __init__(self, period: int = 8, num_replicas: Optional[int] = None,
                 devices: Optional[Sequence[str]] = None, average_slots: bool = True,
                 block_momentum: float = 0.0, block_lr: float = 1.0,
                 collective_timeout: float = 0.0):
        hooks.verify()  # the installed TF / Keras / keras-hub are the ones tfdist hooks into
        if not isinstance(period, int) or period < 1:
            raise ValueError(f"period must be a positive integer; received period={period!r}.")
        if not 0 <= block_momentum < 1:
            raise ValueError(f"block_momentum must be in [0, 1); received {block_momentum!r}.")
        if block_lr <= 0:
            raise ValueError(f"block_lr must be positive; received {block_lr!r}.")
        if devices is None and num_replicas is None:
            num_replicas = max(1, len(tf.config.list_logical_devices("GPU")))
        n = len(devices) if devices is not None else num_replicas
        devices = resolve_devices(Mesh.parse(f"data:{n}"), devices)
        engine = TFCollectiveBackend(devices, timeout_seconds=collective_timeout)
        install_keras_hooks()
        super().__init__(AveragingExtended(self, devices, engine, period, average_slots,
                                           block_momentum, block_lr))
        self.engine = engine

    @property
    def period(self) -> int:
        return self.extended.period

    def average_now(self, variables) -> None:
        """Averages `variables` (e.g. `model.weights`) over the replicas now."""
        n = self.num_replicas_in_sync
        for var in variables:
            var = getattr(var, "value", var)  # a Keras variable's tf.Variable
            if isinstance(var, tf.distribute.DistributedValues):
                mean = sum(v.read_value() for v in var.values) / n
                for v in var.values:
                    v.assign(mean)

    def checkpoint_state(self):
        """The averaging counters, BMUF state and replica copies (`tfdist.checkpoint` saves them)."""
        return self.extended.state_arrays()

    def restore_checkpoint_state(self, arrays) -> None:
        self.extended.restore_state(arrays)

    def bytes_per_step(self) -> float:
        """Bytes each replica sends per optimizer step (ring all-reduce)."""
        n = self.num_replicas_in_sync
        return 2 * (n - 1) / n * self.extended.averaged_bytes / self.period


class CommunicationBytes(keras.callbacks.Callback):
    """Adds `comm_bytes_per_step` (per replica, ring all-reduce) to the logs.

    For a `ModelAveragingStrategy` it is the averaged bytes over `period`; for
    any other data-parallel strategy, one all-reduce of the trainable weights'
    gradients per step.
    """

    def __init__(self, strategy):
        super().__init__()
        self.strategy = strategy

    def value(self) -> float:
        if isinstance(self.strategy, ModelAveragingStrategy):
            return self.strategy.bytes_per_step()
        n = self.strategy.num_replicas_in_sync
        grads = sum(math.prod(w.shape) * tf.as_dtype(w.dtype).size
                    for w in self.model.trainable_weights)
        return 2 * (n - 1) / n * grads

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["comm_bytes_per_step"] = self.value()

    def on_train_batch_end(self, batch, logs=None):
        if logs is not None:
            logs["comm_bytes_per_step"] = self.value()
