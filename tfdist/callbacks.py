"""Keras callbacks for runs that must survive faults: chief-only, atomic, global."""

import os

import keras

from tfdist import checkpoint
from tfdist.internal.keras_fit import set_initial_epoch

_PREFIX = "epoch-"


def is_chief(strategy=None) -> bool:
    """Whether this process writes checkpoints and logs.

    True for a single process and for the controller of a tfdist mesh over
    workers; under `HorovodStrategy` for rank 0; under
    `MultiWorkerMirroredStrategy` only for the `chief` task,
    or `worker` 0 when the cluster has no chief.
    """
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()
    if hasattr(strategy, "rank"):  # HorovodStrategy
        return strategy.rank == 0
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return True
    task_type, task_id = resolver.task_type, resolver.task_id
    jobs = resolver.cluster_spec().as_dict()
    if "chief" in jobs:
        return task_type == "chief"
    return task_type == "worker" and task_id == 0


def on_chief(*callbacks, strategy=None):
    """`callbacks` on the chief, nothing elsewhere: for Keras's own writers.

    Keras's `ModelCheckpoint`, `TensorBoard`, `CSVLogger`... write from every
    process of a multi-process job, to the same paths. Wrap them:
    `model.fit(..., callbacks=on_chief(ModelCheckpoint(path), TensorBoard(logs)))`.
    """
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()
    if getattr(strategy, "collective_weight_reads", False):
        savers = [c for c in callbacks
                  if isinstance(c, (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore))]
        if savers:
            raise ValueError(
                f"{type(savers[0]).__name__} on the chief alone would hang under {strategy!r}: "
                f"reading sharded weights globally gathers them from every rank. Use "
                f"tfdist.callbacks.BackupAndRestore(dir) on every rank (all gather, rank 0 "
                f"writes) or call tfdist.checkpoint.global_arrays on every rank.")
    return list(callbacks) if is_chief(strategy) else []


class BackupAndRestore(keras.callbacks.Callback):
    """Resumes an interrupted `fit` where its last completed epoch left it.

    At the end of every epoch the chief writes the global weights and the
    optimizer state to `backup_dir/epoch-<n>.npz` (`tfdist.checkpoint.save_global`:
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
        self.delete_on_end = delete_on_end
        self.restored_epoch = None

    def _backups(self):
        """`{epoch: path}` of the complete backups."""
        if not os.path.isdir(self.backup_dir):
            return {}
        found = {}
        for name in os.listdir(self.backup_dir):
            stem = name[len(_PREFIX):-len(".npz")]
            if name.startswith(_PREFIX) and name.endswith(".npz") and stem.isdigit():
                found[int(stem)] = os.path.join(self.backup_dir, name)
        return found

    def latest_epoch(self) -> int:
        """The epoch (0-based) of the newest complete backup, or -1 if there is none.

        `fit` resumes at `latest_epoch() + 1`; a repeated dataset can skip the
        batches of the epochs already done so the run continues where it stopped.
        """
        return max(self._backups(), default=-1)

    def on_train_begin(self, logs=None):
        backups = self._backups()
        if not backups:
            return
        epoch = max(backups)
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with self.model.distribute_strategy.scope():
                optimizer.build(self.model.trainable_variables)
        checkpoint.load_global(self.model, backups[epoch])
        set_initial_epoch(self.model, epoch + 1)
        self.restored_epoch = epoch
        print(f"tfdist: resumed from {backups[epoch]} (after epoch {epoch + 1})", flush=True)

    def on_epoch_end(self, epoch, logs=None):
        arrays = checkpoint.global_arrays(self.model)  # every process: may be a collective
        if not is_chief(self.model.distribute_strategy):
            return
        checkpoint.write_arrays(arrays, os.path.join(self.backup_dir, f"{_PREFIX}{epoch}.npz"))
        for old, path in self._backups().items():
            if old < epoch:
                os.unlink(path)

    def on_train_end(self, logs=None):
        if self.delete_on_end and is_chief(self.model.distribute_strategy):
            for path in self._backups().values():
                os.unlink(path)
