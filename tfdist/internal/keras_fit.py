"""Makes a running Keras `fit` start later: at an epoch, and past its first batches.

Private Keras API used: the model attribute `_initial_epoch`, set to `None` by
`keras.src.trainers.trainer.Trainer.__init__` and read by the TensorFlow
backend's `fit` right after `callbacks.on_train_begin()`:
`initial_epoch = self._initial_epoch or initial_epoch`. Keras's own
`keras.callbacks.BackupAndRestore` resumes the same way. And the attribute
`train_function`, which the TensorFlow backend's `fit` builds before
`on_train_begin` and calls once per execution (`steps_per_execution` batches)
with the epoch's iterator: `skip_batches` replaces it for the first calls.

Why: a callback cannot change `fit`'s `initial_epoch` argument, and Keras has
no public hook for it. `tfdist.callbacks.BackupAndRestore.on_train_begin` calls
`set_initial_epoch` after restoring the weights. Checked by
`tests/internal/test_keras_fit.py` (a real `fit` starts at that epoch and
skips those batches). Keras's own callback resumes at the epoch only, so a run
saved mid-epoch would see that epoch's first batches twice.
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


def skip_batches(model, batches: int) -> None:
    """Makes the `fit` starting on `model` consume its first `batches` batches untrained.

    Call it from a callback's `on_train_begin` (after `set_initial_epoch`): the
    first epoch `fit` runs then trains from batch `batches` on, as a run that was
    interrupted after them continues. `batches` must be a multiple of the
    model's `steps_per_execution` (backups are taken at the end of an execution).
    """
    if isinstance(batches, bool) or not isinstance(batches, numbers.Integral) or batches < 0:
        raise ValueError(
            f"The batches to skip must be a non-negative integer; received {batches!r}.")
    per_call = int(getattr(model, "steps_per_execution", 1) or 1)
    if batches % per_call:
        raise ValueError(f"Cannot skip {batches} batches with steps_per_execution={per_call}: "
                         f"a resumed fit starts at an execution boundary.")
    train_function = getattr(model, "train_function", None)
    if train_function is None:
        raise RuntimeError(
            f"{type(model).__name__} has no `train_function` yet: call skip_batches from "
            f"a callback's on_train_begin (Keras builds it at the start of fit).")
    remaining = [batches // per_call]

    def skipping(iterator):
        if remaining[0] == 0:
            model.train_function = train_function
            return train_function(iterator)
        remaining[0] -= 1
        for _ in range(per_call):
            next(iterator)
        return {}

    if remaining[0]:
        model.train_function = skipping
