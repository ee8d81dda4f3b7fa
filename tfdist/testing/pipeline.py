"""A pipeline against one device accumulating the same batch (in-process and job tests).

The reference is a plain Keras `Sequential` of the same layers on one device,
rebuilt from the layers' configs and given the pipeline's initial weights, and
trained with Keras's own `fit` on whole batches: it shares no code with
`tfdist.pipeline`. Batches of 22 rows, so m = 9 micro-batches have sizes
3,3,3,3,2,2,2,2,2 and m = 5 over 2 data replicas 3,2,2,2,2 and 2,2,2,2,2.
"""

import keras
import numpy as np
import tensorflow as tf

ROWS, BATCH, STEPS, D_IN, D_OUT = 220, 22, 10, 8, 4


def stage_layers(k):
    """Stage k's two layers (tanh, linear), named for their stage."""
    return [keras.layers.Dense(16, activation="tanh", name=f"s{k}_a"),
            keras.layers.Dense(16, name=f"s{k}_b")]


def stages(count):
    """`count` Sequential stages of `stage_layers`, a linear head on the last."""
    found = [keras.Sequential(stage_layers(k)) for k in range(count)]
    found[-1].add(keras.layers.Dense(D_OUT, name="head"))
    return found


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, D_IN)).astype("float32")
    y = np.tanh(x @ rng.normal(size=(D_IN, D_OUT))).astype("float32")
    return x, y


def reference(pipeline, device="/cpu:0"):
    """One device: the same layers (from their configs), the pipeline's weights."""
    layers = [type(layer).from_config(layer.get_config())
              for stage in pipeline.stages for layer in _leaves(stage)]
    with tf.device(device):
        model = keras.Sequential([keras.Input((D_IN,))] + layers)
    model.set_weights([w for stage in pipeline.stages for w in stage.get_weights()])
    return model


def _leaves(stage):
    return [layer for layer in stage.layers if not isinstance(layer, keras.layers.InputLayer)]


def relative(a, b):
    """Relative L2 difference ||a - b|| / ||b||."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def assert_matches_one_device(pipeline, ref, rtol=1e-5, optimizer=None):
    """Predict, loss and gradients of one batch, 10 Adam steps with `fit` (loss
    history, weights) and `evaluate` of `pipeline` against `ref`; returns a report.

    `optimizer()` makes each model's optimizer (default: Adam(1e-2)); with
    Keras's options (global clipping, EMA, accumulation) both apply them.
    """
    x, y = data()
    initial = ref.get_weights()
    forward = relative(pipeline.predict(x, batch_size=BATCH, verbose=0),
                       ref.predict(x, batch_size=BATCH, verbose=0))
    assert forward < rtol, forward

    mse = keras.losses.MeanSquaredError()
    step = tf.function(lambda a, b: pipeline.executor.loss_and_gradients(
        a, b, lambda y_i, p_i, w_i: mse(y_i, p_i, w_i)))
    loss, grads, _ = step(x[:BATCH], y[:BATCH])
    with tf.GradientTape() as tape:
        ref_loss = mse(y[:BATCH], ref(x[:BATCH]))
    ref_grads = tape.gradient(ref_loss, ref.trainable_variables)
    loss_error = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
    assert loss_error <= rtol / 10, loss_error
    flat = [g for stage in grads for g in stage]
    assert len(flat) == len(ref_grads)
    grad_error = max(relative(g, r) for g, r in zip(flat, ref_grads))
    assert grad_error < rtol, grad_error

    for model in (pipeline, ref):
        model.compile(optimizer() if optimizer else keras.optimizers.Adam(1e-2), "mse")
    history = pipeline.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    ref_history = ref.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    assert pipeline.optimizer.iterations.numpy() == ref.optimizer.iterations.numpy()
    history_error = abs(history["loss"][0] - ref_history["loss"][0]) / ref_history["loss"][0]
    assert history_error < rtol, history_error
    weight_error = max(relative(w, r) for w, r in zip(pipeline.get_weights(), ref.get_weights()))
    assert weight_error < rtol, weight_error
    slots = max((relative(a, b) for a, b in zip(pipeline.optimizer.variables,
                                                ref.optimizer.variables)), default=0.0)
    assert slots < rtol, slots
    moved = relative(ref.get_weights()[0], initial[0])
    assert moved > 1e-2, moved  # the comparison is not of initial values
    evaluated = pipeline.evaluate(x, y, batch_size=BATCH, verbose=0)
    ref_evaluated = ref.evaluate(x, y, batch_size=BATCH, verbose=0)
    assert abs(evaluated - ref_evaluated) <= rtol * ref_evaluated
    return (f"forward {forward:.1e}, loss {loss_error:.1e}, gradients {grad_error:.1e}, "
            f"loss history {history_error:.1e}, weights after {STEPS} Adam steps "
            f"{weight_error:.1e}, optimizer variables {slots:.1e} (relative L2; weights moved "
            f"{moved:.2f})")
