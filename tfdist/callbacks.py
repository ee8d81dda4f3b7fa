"""Keras callbacks for runs that must survive faults: chief-only, atomic, global."""

import keras

from tfdist import checkpoint, runtime
from tfdist.internal.keras_fit import set_initial_epoch, skip_batches
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
    """Resumes an interrupted `fit` exactly where its last backup left it.

    Keras's arguments and file-safety rules, on global tensors: the chief
    writes the global weights, the optimizer state and the random-generator
    states (dropout masks...) to `backup_dir` (`tfdist.checkpoint.Backups`:
    written under a temporary name, then renamed, so a file is complete or
    absent) and then removes the older backups. At the start of `fit`, every
    process loads the newest backup and `fit` continues from its position: the
    next epoch, or, for a backup taken after `b` batches, batch `b` of that
    epoch (its first `b` batches are consumed untrained; Keras's own callback
    would train them again). A run killed at any point and restarted ends with
    the weights of a run that was never interrupted, dropout included (the
    data must be the same each epoch, e.g. `shuffle=False` or a seeded
    pipeline). Works under MeshStrategy (global tensors: resume on another
    mesh), multi-worker strategies and HorovodStrategy (every process gathers
    the global values, the chief writes, all read; the directory must be shared).

    Args:
        backup_dir: where the backups live.
        save_freq: `"epoch"` (a backup after every epoch), or an integer `n`:
            also one every `n` batches (at the end of the execution that
            reaches them, with `steps_per_execution`).
        delete_checkpoint: remove the backups when `fit` completes (Keras's
            default).
        checkpoint_format: "npz" (global tensors: every process gathers, the
            chief writes) or "sharded" (each process writes its own shards,
            nothing is gathered; `tfdist.sharded_checkpoint`). Either resumes
            on another mesh.
    """

    def __init__(self, backup_dir: str, save_freq="epoch", delete_checkpoint: bool = True,
                 checkpoint_format: str = "npz"):
        super().__init__()
        fmt = checkpoint.format_named(checkpoint_format)
        if save_freq != "epoch" and (isinstance(save_freq, bool)
                                     or not isinstance(save_freq, int) or save_freq < 1):
            raise ValueError(f"save_freq must be 'epoch' or a positive integer (batches); "
                             f"received save_freq={save_freq!r}.")
        self.backup_dir = backup_dir
        self.backups = checkpoint.Backups(backup_dir, fmt)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.restored_epoch = None  # the last completed epoch of the backup resumed from
        self.restored_position = None  # (epoch, batches done in it) resumed at
        self._epoch = 0
        self._last_saved_batch = 0

    def latest_epoch(self) -> int:
        """The epoch (0-based) of the newest end-of-epoch backup, or -1 if there is none.

        A repeated dataset can skip the batches of the epochs already done so
        the run continues where it stopped.
        """
        return self.backups.latest_epoch()

    def on_train_begin(self, logs=None):
        position = self.backups.latest()
        if position is None:
            return
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with self.model.distribute_strategy.scope():
                optimizer.build(self.model.trainable_variables)
        path = self.backups.positions()[position]
        checkpoint.load(self.model, path, fmt=self.backups.fmt)
        epoch, batch = position
        set_initial_epoch(self.model, epoch)
        skip_batches(self.model, batch)
        self.restored_position = position
        self.restored_epoch = epoch - 1
        self._last_saved_batch = batch
        print(f"tfdist: resumed from {path} (epoch {epoch + 1}, batch {batch})", flush=True)

    def on_epoch_begin(self, epoch, logs=None):
        if epoch != self._epoch:
            self._last_saved_batch = 0
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        done = batch + 1
        if self.save_freq == "epoch" or done <= self._last_saved_batch:
            return  # (batches a resumed fit skipped are not trained again)
        if done - self._last_saved_batch >= self.save_freq:
            self.backups.save(self.model, self._epoch, done)
            self._last_saved_batch = done

    def on_epoch_end(self, epoch, logs=None):
        self.backups.save(self.model, epoch)  # every process gathers, the chief writes
        self._epoch, self._last_saved_batch = epoch + 1, 0

    def on_train_end(self, logs=None):
        if self.delete_checkpoint:
            self.backups.delete_all(self.model.distribute_strategy)


class SpeedProportionalBatches(keras.callbacks.Callback):
    """Gives each Horovod rank a share of every global batch proportional to its speed.

    For `HorovodStrategy(batch_shares=...)` on unequal devices (HAP's ratios,
    dynamic batch sizing): at the start of training and every `every` batches,
    each rank times a fixed matrix-multiply probe on its own device (`probe`),
    the ranks exchange their rates, and the shares move to
    `smoothing * old + (1 - smoothing) * rate / sum(rates)` (at least
    `min_share` each), taking effect on every rank at the same step. Results
    stay those of one process on the same global batches; only who computes
    which rows changes.

    Args:
        every: batches between measurements.
        smoothing: weight of the previous shares (0: the last measurement only).
        min_share: the least share of a rank (it keeps some rows).
        probe: `() -> seconds` of this rank's probe (default: the median of 5
            runs of 96 float32 `[256, 256]` matmuls in a `tf.function`, about 4 ms
            each on a fast core: long enough to span the kernel's time slices
            where a rank shares its core, and the median, as the best of short
            runs catches the moments the other process is off the core and
            overrates the rank; measured in bench/unequal_devices.py).
    """

    def __init__(self, every: int = 20, smoothing: float = 0.5, min_share: float = 0.05,
                 probe=None):
        super().__init__()
        if every < 1 or not 0 <= smoothing < 1 or not 0 < min_share < 1:
            raise ValueError(f"every >= 1, 0 <= smoothing < 1, 0 < min_share < 1; received "
                             f"every={every}, smoothing={smoothing}, min_share={min_share}.")
        self.every, self.smoothing, self.min_share = every, smoothing, min_share
        self._probe = probe
        self.history = []  # the shares set, in order

    def _strategy(self):
        strategy = self.model.distribute_strategy
        if not getattr(strategy.extended, "batch_shares", False):
            raise ValueError("SpeedProportionalBatches needs HorovodStrategy(batch_shares=...).")
        return strategy

    def _seconds(self) -> float:
        import time

        import tensorflow as tf

        if self._probe is not None:
            return self._probe()
        if not hasattr(self, "_matmuls"):
            x = tf.random.stateless_normal([256, 256], seed=[1, 2]) * 0.06

            @tf.function
            def matmuls(x):
                y = x
                for _ in range(96):
                    y = tf.matmul(y, x)
                return tf.reduce_sum(y)

            self._x, self._matmuls = x, matmuls
            self._matmuls(self._x).numpy()  # trace
        runs = []
        for _ in range(5):
            start = time.perf_counter()
            self._matmuls(self._x).numpy()
            runs.append(time.perf_counter() - start)
        return sorted(runs)[2]

    def _measure(self):
        import tensorflow as tf

        strategy = self._strategy()
        rate = 1.0 / max(self._seconds(), 1e-9)
        rates = strategy.hvd.allgather(tf.constant([rate], tf.float64),
                                       name=f"tfdist_speed_{len(self.history)}").numpy()
        target = rates / rates.sum()
        old = strategy.batch_shares
        shares = [self.smoothing * o + (1 - self.smoothing) * t for o, t in zip(old, target)]
        shares = [max(self.min_share, s) for s in shares]
        strategy.set_batch_shares(shares)
        self.history.append(strategy.batch_shares)

    def on_train_begin(self, logs=None):
        self._batches = 0
        self._measure()

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._batches % self.every == 0:
            self._measure()
