"""Makes a running Keras `fit` start at a later epoch (resuming from a backup).

Private Keras API used: the model attribute `_initial_epoch`, set to `None` by
`keras.src.trainers.trainer.Trainer.__init__` and read by the TensorFlow
backend's `fit` right after `callbacks.on_train_begin()`:
`initial_epoch = self._initial_epoch or initial_epoch`. Keras's own
`keras.callbacks.BackupAndRestore` resumes the same way.

Why: a callback cannot change `fit`'s `initial_epoch` argument, and Keras has
no public hook for it. `tfdist.callbacks.BackupAndRestore.on_train_begin` calls
`set_initial_epoch` after restoring the weights. Checked by
`tests/internal/test_keras_fit.py` (a real `fit` starts at that epoch).
"""

import numbers


def set_initial_epoch(model, epoch: int) -> None:
    """Makes the `fit` that is starting on `model` begin at `epoch` (0-based).

    Call it from a callback's `on_train_begin`; `fit` reads the value once,
    before its first epoch, and runs epochs `epoch, ..., epochs - 1`.

    Args:
        model: the `keras.Model` whose `fit` is starting.
        epoch: the first epoch to run, a non-negative integer.

    Raises:
        ValueError: `epoch` is not a non-negative integer.
        RuntimeError: `model` has no `_initial_epoch` (not a Keras 3 model, or a
            Keras version whose `fit` no longer reads it).
    """
    if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch < 0:
        raise ValueError(f"The initial epoch must be a non-negative integer; received {epoch!r}.")
    if not hasattr(model, "_initial_epoch"):
        raise RuntimeError(
            f"{type(model).__name__} has no `_initial_epoch`: tfdist resumes Keras's fit "
            f"through that private attribute of keras.Model (Keras 3); received {model!r}.")
    model._initial_epoch = int(epoch)
