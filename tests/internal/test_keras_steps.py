"""The private Keras detail behind evening out partial batches and gathering `predict`'s
outputs: the names of the steps Keras gives `strategy.run`.

If a Keras upgrade renames `make_<kind>_function` or the step it builds, or
TensorFlow wraps the step so it can no longer be unwrapped, these tests fail first.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.internal.keras_steps import is_keras_predict_step, keras_step_kind


def _steps_given_to_strategy_run(loop: str, jit_compile: bool):
    """The functions Keras passes to `strategy.run` during `model.<loop>(...)`."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    seen = []
    run = strategy.extended._call_for_each_replica

    def recording(fn, args, kwargs):
        seen.append(fn)
        return run(fn, args, kwargs)

    strategy.extended._call_for_each_replica = recording
    with strategy.scope():
        assert tf.distribute.get_strategy() is strategy
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
    x, y = np.ones((4, 3), "float32"), np.ones((4, 2), "float32")
    if loop == "predict":
        model.predict(x, batch_size=2, verbose=0)
    elif loop == "fit":
        model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    else:
        model.evaluate(x, y, batch_size=2, verbose=0)
    assert seen, f"Keras's {loop} did not call strategy.run"
    return seen


@pytest.mark.parametrize("jit_compile", [False, True])
def test_keras_predict_step_is_recognised(jit_compile):
    steps = _steps_given_to_strategy_run("predict", jit_compile)
    assert all(is_keras_predict_step(fn) for fn in steps), [
        getattr(fn, "__qualname__", fn) for fn in steps]


@pytest.mark.parametrize("loop,kind", [("fit", "train"), ("evaluate", "test")])
def test_train_and_test_steps_are_recognised_and_are_not_predict(loop, kind):
    steps = _steps_given_to_strategy_run(loop, jit_compile=False)
    assert all(keras_step_kind(fn) == kind for fn in steps), [
        getattr(fn, "__qualname__", fn) for fn in steps]
    assert not any(is_keras_predict_step(fn) for fn in steps)


def test_wrappers_are_unwrapped_and_other_functions_are_not_matched():
    def make_predict_function():
        def one_step_on_data(data):
            return data
        return one_step_on_data

    step = make_predict_function()

    @functools.wraps(step)
    def wrapped(data):
        return step(data)

    assert is_keras_predict_step(wrapped)
    assert keras_step_kind(wrapped) == "predict"
    assert is_keras_predict_step(tf.function(step))
    assert not is_keras_predict_step(lambda data: data)
    assert not is_keras_predict_step(None)
    assert keras_step_kind(lambda data: data) is None
