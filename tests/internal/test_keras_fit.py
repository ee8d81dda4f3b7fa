"""The private Keras hook behind resuming `fit`: `model._initial_epoch`.

If a Keras upgrade stops reading `_initial_epoch` in `fit`, these tests fail first.
"""

import keras
import numpy as np
import pytest

from tfdist.internal.keras_fit import set_initial_epoch, skip_batches


class _Resume(keras.callbacks.Callback):
    """Sets the initial epoch in `on_train_begin` and records the epochs run."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch, self.epochs_run = epoch, []

    def on_train_begin(self, logs=None):
        if self.epoch is not None:
            set_initial_epoch(self.model, self.epoch)

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs_run.append(epoch)


def _model():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("epoch, expected", [(None, [0, 1, 2, 3]), (0, [0, 1, 2, 3]),
                                             (3, [3]), (4, [])])
def test_fit_starts_at_the_epoch_set_in_on_train_begin(epoch, expected):
    x, y = np.ones((4, 2), "float32"), np.ones((4, 1), "float32")
    model = _model()
    assert model._initial_epoch is None  # Keras's Trainer.__init__ creates it
    callback = _Resume(epoch)
    history = model.fit(x, y, batch_size=2, epochs=4, verbose=0, callbacks=[callback])
    assert callback.epochs_run == expected
    assert history.epoch == expected


def test_bad_epoch_and_non_keras_model_are_named():
    with pytest.raises(ValueError, match=r"non-negative integer; received -1"):
        set_initial_epoch(_model(), -1)
    with pytest.raises(ValueError, match=r"received 1\.5"):
        set_initial_epoch(_model(), 1.5)
    with pytest.raises(RuntimeError, match="object has no `_initial_epoch`"):
        set_initial_epoch(object(), 1)


class _Skip(keras.callbacks.Callback):
    """Skips `batches` batches of the first epoch; records the batches trained."""

    def __init__(self, batches):
        super().__init__()
        self.batches, self.trained = batches, []

    def on_train_begin(self, logs=None):
        skip_batches(self.model, self.batches)

    def on_train_batch_end(self, batch, logs=None):
        if logs:
            self.trained.append(batch)


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_fit_consumes_the_skipped_batches_untrained(steps_per_execution):
    x = np.arange(12, dtype="float32").reshape(6, 2)
    y = np.ones((6, 1), "float32")
    model = _model()
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
    callback = _Skip(2)
    model.fit(x, y, batch_size=1, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
    per_call = steps_per_execution
    first = list(range(2 + per_call - 1, 6, per_call))
    assert callback.trained == first + list(range(per_call - 1, 6, per_call))
    assert int(model.optimizer.iterations.numpy()) == 4 + 6  # batches 2-5, then all 6
    with pytest.raises(ValueError, match="Cannot skip 3 batches with steps_per_execution=2"):
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
        model.fit(x, y, batch_size=1, verbose=0, callbacks=[_Skip(3)])
