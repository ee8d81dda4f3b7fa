"""A pipeline over virtual devices trains like one device accumulating the same batch.

The reference is a plain Keras `Sequential` of the same layers on one device,
given the pipeline's initial weights and trained with Keras's own `fit` on
whole batches: it shares no code with `tfdist.pipeline`. The pipeline splits
each batch of 22 rows into m micro-batches (m = 9: sizes 3,3,3,3,2,2,2,2,2)
and runs GPipe or 1F1B over p devices.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.pipeline.model import Pipeline

ROWS, BATCH, STEPS, D_IN, D_OUT = 220, 22, 10, 8, 4


def _stage(k):
    return keras.Sequential([keras.layers.Dense(16, activation="tanh", name=f"s{k}_a"),
                             keras.layers.Dense(16, name=f"s{k}_b")])


def _stages(count):
    stages = [_stage(k) for k in range(count)]
    stages[-1].add(keras.layers.Dense(D_OUT, name="head"))
    return stages


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, D_IN)).astype("float32")
    y = np.tanh(x @ rng.normal(size=(D_IN, D_OUT))).astype("float32")
    return x, y


def _reference(pipeline):
    """One device: the same layers (from their configs), the pipeline's weights."""
    layers = [keras.layers.Dense.from_config(layer.get_config())
              for stage in pipeline.stages for layer in stage.layers]
    with tf.device("/cpu:0"):
        model = keras.Sequential([keras.Input((D_IN,))] + layers)
    model.set_weights([w for stage in pipeline.stages for w in stage.get_weights()])
    return model


def _relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


CASES = [(schedule, p, m, 1) for schedule in ("gpipe", "1f1b")
         for p, m in [(2, 1), (2, 2), (2, 5), (4, 1), (4, 4), (4, 9)]]
# Interleaved: 2 chunks per device, stage k on device k % p; m below, at and above p.
CASES += [("interleaved_1f1b", 2, 3, 2), ("interleaved_1f1b", 4, 3, 2)]


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_pipeline_matches_one_device_accumulating_the_batch(schedule, p, m, v):
    keras.utils.set_random_seed(p * 10 + m)
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i + 1}" for i in range(p)]
    pipeline = Pipeline(_stages(p * v), devices=devices, schedule=schedule, num_microbatches=m,
                        num_chunks=v, input_shape=(D_IN,))
    for k, stage in enumerate(pipeline.stages):  # every stage's weights on its device
        assert {v.value.device for v in stage.weights} == {devices[k % p]}
    reference = _reference(pipeline)
    initial = reference.get_weights()
    x, y = _data()

    # Forward and predict.
    np.testing.assert_allclose(pipeline.predict(x, batch_size=BATCH, verbose=0),
                               reference.predict(x, batch_size=BATCH, verbose=0),
                               rtol=1e-5, atol=1e-6)

    # Loss and gradients of one batch.
    mse = keras.losses.MeanSquaredError()
    step = tf.function(lambda a, b: pipeline.executor.loss_and_gradients(
        a, b, lambda y_i, p_i, w_i: mse(y_i, p_i, w_i)))
    loss, grads, _ = step(x[:BATCH], y[:BATCH])
    with tf.GradientTape() as tape:
        ref_loss = mse(y[:BATCH], reference(x[:BATCH]))
    ref_grads = tape.gradient(ref_loss, reference.trainable_variables)
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss))
    flat = [g for stage in grads for g in stage]
    assert len(flat) == len(ref_grads)
    for g, r in zip(flat, ref_grads):
        assert _relative(g, r) < 1e-5

    # Ten Adam steps with Keras's fit, loss history and weights.
    for model in (pipeline, reference):
        model.compile(keras.optimizers.Adam(1e-2), "mse")
    history = pipeline.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    ref_history = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False,
                                verbose=0).history
    assert pipeline.optimizer.iterations.numpy() == STEPS
    assert abs(history["loss"][0] - ref_history["loss"][0]) < 1e-5 * ref_history["loss"][0]
    for w, r in zip(pipeline.get_weights(), reference.get_weights()):
        assert _relative(w, r) < 1e-5
    # The run moved the weights (the comparison is not of initial values).
    assert _relative(reference.get_weights()[0], initial[0]) > 1e-2
    assert pipeline.evaluate(x, y, batch_size=BATCH, verbose=0) == pytest.approx(
        reference.evaluate(x, y, batch_size=BATCH, verbose=0), rel=1e-5)


class _Recorder(keras.layers.Layer):
    """Passes its input through and logs `("F", stage)` when its forward runs and
    `("B", stage)` when its gradient does (a `py_function` on the data path)."""

    def __init__(self, stage, log, **kwargs):
        super().__init__(**kwargs)
        self.stage, self.log = stage, log

    def _logged(self, kind, value):
        def record(v):
            self.log.append((kind, self.stage))
            return v

        out = tf.py_function(record, [value], value.dtype)
        out.set_shape(value.shape)
        return out

    def call(self, x):
        @tf.custom_gradient
        def passthrough(x):
            return self._logged("F", x), lambda dy: self._logged("B", dy)

        return passthrough(x)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_device_runs_its_actions_in_the_schedules_order(schedule):
    """The order is the schedule's, not whatever the dataflow allows: GPipe runs
    every forward before any backward, 1F1B alternates once warmed up."""
    p, m = 2, 4
    log = []
    stages = [keras.Sequential([_Recorder(k, log), keras.layers.Dense(4)]) for k in range(p)]
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i + 1}" for i in range(p)]
    pipeline = Pipeline(stages, devices=devices, schedule=schedule, num_microbatches=m,
                        input_shape=(D_IN,))
    x, y = _data()
    step = tf.function(lambda a, b: pipeline.executor.loss_and_gradients(
        a, b[:, :4], lambda y_i, p_i, w_i: tf.reduce_mean((y_i - p_i) ** 2)))
    step.get_concrete_function(x[:8], y[:8])  # tracing logs nothing
    log.clear()
    step(x[:8], y[:8])
    for k in range(p):
        ran = [kind for kind, stage in log if stage == k]
        planned = [a.kind[0].upper() for a in pipeline.executor.schedule.actions[k]
                   if a.is_compute]
        assert ran == planned, (k, ran, planned)
    assert [kind for kind, stage in log if stage == 0] == (
        list("FFFFBBBB") if schedule == "gpipe" else list("FFBFBFBB"))


def test_bad_arguments_are_one_clear_error():
    with pytest.raises(ValueError, match="schedule='pipedream': valid schedules are"):
        Pipeline(_stages(2), schedule="pipedream", input_shape=(D_IN,))
    with pytest.raises(ValueError, match="3 stages do not divide into num_chunks=2"):
        Pipeline(_stages(3), schedule="interleaved_1f1b", num_chunks=2, input_shape=(D_IN,))
    with pytest.raises(ValueError, match="has 2 devices but 3 were given"):
        Pipeline(_stages(2), devices=["/cpu:0", "/cpu:1", "/cpu:2"], input_shape=(D_IN,))
    with pytest.raises(ValueError, match="num_microbatches=0: must be an integer >= 1"):
        Pipeline(_stages(2), num_microbatches=0, input_shape=(D_IN,))
