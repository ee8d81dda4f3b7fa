"""Keras callbacks for runs that must survive faults: chief-only, atomic, global."""

import keras

from tfdist import checkpoint, runtime
from tfdist.internal.keras_fit import set_initial_epoch
from tfdist.runtime import is_chief

__all__ = ["BackupAndRestore", "is_chief", "on_chief"]


def on_chief(*callbacks, strategy=None):
    """`callbacks` on the chief, nothing elsewhere: for Keras's own writers.

    Keras's `ModelCheckpoint`, `TensorBoard`, `CSVLogger`... write from every
    process of a multi-process job, to the same paths. Wrap them:
    `model.fit(..., callbacks=on_chief(ModelCheckpoint(path), TensorBoard(logs)))`.
    """
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()
    mesh_runtime = runtime.current_runtime(strategy)
    if mesh_runtime is not None and mesh_runtime.collective_weight_reads:
        savers = [c for c in callbacks
                  if isinstance(c, (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore))]
        if savers:
            raise ValueError(
                f"{type(savers[0]).__name__} on the chief alone would hang under {strategy!r}: "
                f"reading sharded weights globally gathers them from every rank. Use "
                f"tfdist.callbacks.BackupAndRestore(dir) on every rank (all gather, rank 0 "
                f"writes) or call tfdist.checkpoint.save on every rank.")
    return list(callbacks) if is_chief(strategy) else []


class BackupAndRestore(keras.callbacks.Callback):
    """Resumes an interrupted `fit` where its last completed epoch left it.

    At the end of every epoch the chief writes the global weights and the
    optimizer state to `backup_dir/epoch-<n>.npz` (`tfdist.checkpoint.Backups`:
    written under a temporary name, then renamed, so a file is complete or
    absent) and then removes the older ones. At the start of `fit`, every
    process loads the newest backup and `fit` continues from the next epoch,
    so a run killed at any point and restarted ends with the weights of a run
    that was never interrupted (the data must be the same each epoch, e.g.
    `shuffle=False` or a seeded pipeline). Works under MeshStrategy (global
    tensors: resume on another mesh), multi-worker strategies and
    HorovodStrategy (every process gathers the global values, the chief
    writes, all read; the directory must be shared).

    Args:
        backup_dir: where the backups live.
        delete_on_end: remove the backups when `fit` completes.
    """

    def __init__(self, backup_dir: str, delete_on_end: bool = False):
        super().__init__()
        self.backup_dir = backup_dir
        self.backups = checkpoint.Backups(backup_dir)
        self.delete_on_end = delete_on_end
        self.restored_epoch = None

    def latest_epoch(self) -> int:
        """The epoch (0-based) of the newest complete backup, or -1 if there is none.

        `fit` resumes at `latest_epoch() + 1`; a repeated dataset can skip the
        batches of the epochs already done so the run continues where it stopped.
        """
        return self.backups.latest_epoch()

    def on_train_begin(self, logs=None):
        epoch = self.backups.latest_epoch()
        if epoch < 0:
            return
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with self.model.distribute_strategy.scope():
                optimizer.build(self.model.trainable_variables)
        path = self.backups.path(epoch)
        checkpoint.load(self.model, path)
        set_initial_epoch(self.model, epoch + 1)
        self.restored_epoch = epoch
        print(f"tfdist: resumed from {path} (after epoch {epoch + 1})", flush=True)

    def on_epoch_end(self, epoch, logs=None):
        self.backups.save(self.model, epoch)  # every process gathers, the chief writes

    def on_train_end(self, logs=None):
        if self.delete_on_end:
            self.backups.delete_all(self.model.distribute_strategy)
