"""A pipeline over virtual devices trains like one device accumulating the same batch.

`tfdist.testing.pipeline` holds the comparison: a plain Keras `Sequential` of
the same layers on one device (no code shared with `tfdist.pipeline`), given
the pipeline's initial weights, against the pipeline split into p stages and m
micro-batches: predict, loss, gradients, 10 Adam steps with `fit`, evaluate.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.pipeline.layout import PipelinePlan
from tfdist.pipeline.model import Pipeline
from tfdist.testing.pipeline import (
    BATCH, D_IN, D_OUT, assert_matches_one_device, data, reference, relative, stages)


def _cpus(count, first=1):
    return [f"/job:localhost/replica:0/task:0/device:CPU:{i + first}" for i in range(count)]


CASES = [(schedule, p, m, 1) for schedule in ("gpipe", "1f1b")
         for p, m in [(2, 1), (2, 2), (2, 5), (4, 1), (4, 4), (4, 9)]]
# Interleaved: 2 chunks per device, stage k on device k % p; m below, at and above p.
CASES += [("interleaved_1f1b", 2, 3, 2), ("interleaved_1f1b", 4, 3, 2)]


@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_pipeline_matches_one_device_accumulating_the_batch(schedule, p, m, v):
    keras.utils.set_random_seed(p * 10 + m)
    devices = _cpus(p)
    pipeline = Pipeline(stages(p * v), devices=devices, schedule=schedule, num_microbatches=m,
                        num_chunks=v, input_shape=(D_IN,))
    for k, stage in enumerate(pipeline.stages):  # every stage's weights on its device
        assert {w.value.device for w in stage.weights} == {devices[k % p]}
    print(assert_matches_one_device(pipeline, reference(pipeline)))


@pytest.mark.parametrize("options", [
    {"global_clipnorm": 0.05}, {"clipvalue": 0.01}, {"use_ema": True, "ema_overwrite_frequency": 3},
    {"gradient_accumulation_steps": 2}, {"weight_decay": 0.1}])
def test_keras_optimizer_options_apply_as_on_one_device(options):
    """The optimizer sees the whole step's gradients at once, so its options act
    on the batch's gradient: global clipping by the norm over all stages."""
    keras.utils.set_random_seed(11)
    pipeline = Pipeline(stages(2), devices=_cpus(2), schedule="1f1b", num_microbatches=3,
                        input_shape=(D_IN,))
    print(assert_matches_one_device(pipeline, reference(pipeline), optimizer=lambda: (
        keras.optimizers.AdamW(1e-2, **options) if "weight_decay" in options
        else keras.optimizers.Adam(1e-2, **options))))


@pytest.mark.parametrize("mesh_shape,m", [("stage:2;data:2", 5), ("data:2;stage:2", 2)])
def test_stage_and_data_axes_from_the_layout_match_one_device(mesh_shape, m):
    """`layers:stage;batch:data`: two pipelines side by side, each on its half
    of every batch; the stages' variables on data replica 0's devices."""
    keras.utils.set_random_seed(7)
    plan = PipelinePlan.from_mesh(mesh_shape, "layers:stage;batch:data", num_layers=8,
                                  num_microbatches=m, global_batch=22)
    blocks = [keras.layers.Dense(16, activation="tanh" if j % 2 == 0 else None,
                                 name=f"block_{j}") for j in range(8)]
    devices = _cpus(4)
    pipeline = Pipeline.from_plan(plan, blocks, devices, input_shape=(D_IN,),
                                  last=[keras.layers.Dense(D_OUT, name="head")])
    assert pipeline.executor.grid == [tuple(devices[i] for i in plan.stage_devices(s))
                                      for s in range(2)]
    for s, stage in enumerate(pipeline.stages):
        assert {w.value.device for w in stage.weights} == {devices[plan.stage_devices(s)[0]]}
        assert [layer.name for layer in stage.layers][:4] == [
            f"block_{j}" for j in plan.layers_of(s)]
    print(assert_matches_one_device(pipeline, reference(pipeline)))


def test_a_functional_model_cut_at_named_layers_matches_it():
    """Residual connections inside the stages; the cuts after `mid` and `late`."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((D_IN,))
    h = keras.layers.Dense(16, activation="tanh", name="early")(inputs)
    h = keras.layers.Add(name="mid")([h, keras.layers.Dense(16, name="mid_a")(h)])
    h = keras.layers.Add(name="late")([h, keras.layers.Dense(16, activation="tanh",
                                                             name="late_a")(h)])
    outputs = keras.layers.Dense(D_OUT, name="out")(keras.layers.Dense(16, name="out_a")(h))
    model = keras.Model(inputs, outputs)
    devices = _cpus(3)
    pipeline = Pipeline.from_model(model, ["mid", "late"], devices=devices, schedule="1f1b",
                                   num_microbatches=4)
    assert [sorted(w.path.split("/")[-2] for w in stage.weights) for stage in pipeline.stages] \
        == [["early", "early", "mid_a", "mid_a"], ["late_a", "late_a"],
            ["out", "out", "out_a", "out_a"]]
    for k, stage in enumerate(pipeline.stages):
        assert {w.value.device for w in stage.weights} == {devices[k]}
    x, y = data()
    np.testing.assert_allclose(pipeline.predict(x, verbose=0), model.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)
    initial = model.get_weights()
    for m in (pipeline, model):
        m.compile(keras.optimizers.Adam(1e-2), "mse")
    pipeline.fit(x, y, batch_size=22, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=22, shuffle=False, verbose=0)
    by_name = {tuple(w.path.split("/")[-2:]): w.numpy() for w in model.weights}
    for stage in pipeline.stages:
        for w in stage.weights:
            assert relative(w.numpy(), by_name[tuple(w.path.split("/")[-2:])]) < 1e-5, w.path
    assert relative(model.get_weights()[0], initial[0]) > 1e-2

    with pytest.raises(ValueError, match=r"split_at names \['nope'\], not layers of"):
        Pipeline.from_model(model, ["nope"])
    with pytest.raises(ValueError, match=r"give distinct layers in the model's order, e.g. "
                                         r"\['mid', 'late'\]"):
        Pipeline.from_model(model, ["late", "mid"])


class _Recorder(keras.layers.Layer):
    """Passes its input through and logs `("F", stage)` when its forward runs and
    `("B", stage)` when its gradient does (a `py_function` on the data path)."""

    def __init__(self, stage, log, **kwargs):
        super().__init__(**kwargs)
        self.stage, self.append = stage, log.append  # a list attribute would be copied

    def _logged(self, kind, value):
        def record(v):
            self.append((kind, self.stage))
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
    # After a Dense layer: its backward is needed (the kernel's gradient) on every stage.
    recorded = [keras.Sequential([keras.layers.Dense(4), _Recorder(k, log)]) for k in range(p)]
    pipeline = Pipeline(recorded, devices=_cpus(p), schedule=schedule, num_microbatches=m,
                        input_shape=(D_IN,))
    x, y = data()
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
        Pipeline(stages(2), schedule="pipedream", input_shape=(D_IN,))
    with pytest.raises(ValueError, match="3 stages do not divide into num_chunks=2"):
        Pipeline(stages(3), schedule="interleaved_1f1b", num_chunks=2, input_shape=(D_IN,))
    with pytest.raises(ValueError, match="has 2 devices but 3 were given"):
        Pipeline(stages(2), devices=["/cpu:0", "/cpu:1", "/cpu:2"], input_shape=(D_IN,))
    with pytest.raises(ValueError, match="num_microbatches=0: must be an integer >= 1"):
        Pipeline(stages(2), num_microbatches=0, input_shape=(D_IN,))


def test_dropout_draws_one_mask_per_microbatch_as_one_device_looping_over_them():
    """What "exact" means for dropout: each micro-batch draws its own mask (each
    Dropout layer's seed advances once per micro-batch, in micro-batch order),
    so a step equals one device running the same micro-batches one after the
    other and summing their gradients -- not one device drawing one mask for
    the whole batch, whose masks differ (checked too)."""
    p, m, steps = 2, 3, 3
    keras.utils.set_random_seed(5)
    with_dropout = [keras.Sequential([keras.layers.Dense(16, activation="tanh"),
                                      keras.layers.Dropout(0.3, seed=40 + k),
                                      keras.layers.Dense(16)]) for k in range(p)]
    with_dropout[-1].add(keras.layers.Dense(D_OUT))
    pipeline = Pipeline(with_dropout, devices=_cpus(p), schedule="1f1b", num_microbatches=m,
                        input_shape=(D_IN,))
    ref = reference(pipeline)
    whole = reference(pipeline)
    x, y = data()
    pipeline.compile(keras.optimizers.SGD(0.1), "mse")
    pipeline.fit(x[:22 * steps], y[:22 * steps], batch_size=22, shuffle=False, verbose=0)

    optimizer = keras.optimizers.SGD(0.1)
    for step in range(steps):
        xb, yb = x[22 * step:22 * (step + 1)], y[22 * step:22 * (step + 1)]
        total = None
        for xi, yi in zip(np.array_split(xb, m), np.array_split(yb, m)):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((ref(xi, training=True) - yi) ** 2) * len(xi) / len(xb)
            grads = tape.gradient(loss, ref.trainable_variables)
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
        optimizer.apply_gradients(zip(total, ref.trainable_variables))
    for w, r in zip(pipeline.get_weights(), ref.get_weights()):
        assert relative(w, r) < 1e-5

    whole.compile(keras.optimizers.SGD(0.1), "mse")
    whole.fit(x[:22 * steps], y[:22 * steps], batch_size=22, shuffle=False, verbose=0)
    assert relative(whole.get_weights()[0], ref.get_weights()[0]) > 1e-4


class _TiedOutput(keras.layers.Layer):
    """`h @ kernel^T` with the kernel of a Dense layer on the first stage (tied)."""

    def __init__(self, tied, **kwargs):
        super().__init__(**kwargs)
        self.tied = tied

    def call(self, h):
        return tf.matmul(h, self.tied.kernel, transpose_b=True)


def _tied_model(stage_of=None, devices=None, m=1):
    """Input projection `tied` on stage 0, its transpose as the last stage's
    output: the tied kernel gets the sum of both stages' gradients."""
    tied = keras.layers.Dense(16, use_bias=False, name="tied")
    middle = keras.layers.Dense(16, activation="tanh", name="middle")
    if stage_of is None:  # one device
        return keras.Sequential([keras.Input((D_IN,)), tied, middle, _TiedOutput(tied)])
    return Pipeline([keras.Sequential([tied]), keras.Sequential([middle, _TiedOutput(tied)])],
                    devices=devices, schedule="1f1b", num_microbatches=m, input_shape=(D_IN,))


def test_weights_tied_between_the_first_and_last_stage_get_the_summed_gradient():
    keras.utils.set_random_seed(9)
    devices = _cpus(2)
    pipeline = _tied_model(stage_of=True, devices=devices, m=3)
    with tf.device("/cpu:0"):
        ref = _tied_model()
    tied = pipeline.stages[0].layers[0].kernel
    assert tied.value.device == devices[0]
    assert len(pipeline.trainable_variables) == 3 and len(ref.trainable_variables) == 3
    ref.set_weights(pipeline.get_weights())
    x, _ = data()
    for model in (pipeline, ref):
        model.compile(keras.optimizers.Adam(1e-2), "mse")
    history = pipeline.fit(x, x, batch_size=22, shuffle=False, verbose=0).history
    ref_history = ref.fit(x, x, batch_size=22, shuffle=False, verbose=0).history
    assert abs(history["loss"][0] - ref_history["loss"][0]) < 1e-5 * ref_history["loss"][0]
    for w, r in zip(pipeline.get_weights(), ref.get_weights()):
        assert relative(w, r) < 1e-5
    # One update per step: Adam's step count and one pair of slots for the kernel.
    assert pipeline.optimizer.iterations.numpy() == 10
    assert len(pipeline.optimizer.variables) == len(ref.optimizer.variables)


class _MeanSquarePenalty(keras.layers.Layer):
    """Adds 0.1 * mean(x^2) over its rows (a mean: the micro-batches' shares of it
    sum to the whole batch's), passes x through."""

    def call(self, x):
        self.add_loss(0.1 * tf.reduce_mean(tf.square(x)))
        return x


def test_losses_the_stages_add_count_like_on_one_device():
    """`add_loss` in a stage's call and a kernel regularizer on each stage: the
    loss, gradients, 10 Adam steps and `evaluate` equal the Keras model's (its
    loss includes them too)."""
    keras.utils.set_random_seed(4)

    def stage(k):
        return keras.Sequential([
            keras.layers.Dense(16, activation="tanh", name=f"s{k}_a",
                               kernel_regularizer=keras.regularizers.L2(0.01)),
            _MeanSquarePenalty(name=f"s{k}_penalty"), keras.layers.Dense(16, name=f"s{k}_b")])

    staged = [stage(0), stage(1)]
    staged[-1].add(keras.layers.Dense(D_OUT, name="head"))
    pipeline = Pipeline(staged, devices=_cpus(2), schedule="1f1b", num_microbatches=5,
                        input_shape=(D_IN,))
    ref = reference(pipeline)
    x, y = data()
    ref(x[:2])
    assert len(ref.losses) == 4  # two penalties, two regularizers: the reference counts them
    print(assert_matches_one_device(pipeline, ref))


def test_a_sum_over_rows_added_loss_equals_keras_accumulating_the_micro_batches():
    """Keras's activity regularizer sums over the rows it sees, so a step is a
    one-device step only as Keras's own `gradient_accumulation_steps` over the
    same micro-batches: that is the reference (SGD, equal micro-batches)."""
    keras.utils.set_random_seed(6)
    m, batch = 4, 20

    def layers(penalty=1e-3):
        return [keras.layers.Dense(16, activation="tanh", name="a",
                                   activity_regularizer=keras.regularizers.L2(penalty)),
                keras.layers.Dense(D_OUT, name="b")]

    first, second = layers()
    pipeline = Pipeline([keras.Sequential([first]), keras.Sequential([second])],
                        devices=_cpus(2), schedule="gpipe", num_microbatches=m,
                        input_shape=(D_IN,))
    x, y = data()
    x, y = x[:200], y[:200]
    pipeline.compile(keras.optimizers.SGD(0.1), "mse")
    pipeline_initial = pipeline.get_weights()
    pipeline.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    trained = {}
    for penalty in (1e-3, 0.0):  # the reference, and the same without the added loss
        with tf.device("/cpu:0"):
            ref = keras.Sequential([keras.Input((D_IN,))] + layers(penalty))
        ref.set_weights(pipeline_initial)
        ref.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=m), "mse")
        ref.fit(x, y, batch_size=batch // m, shuffle=False, verbose=0)
        trained[penalty] = ref.get_weights()
    errors = [relative(a, b) for a, b in zip(pipeline.get_weights(), trained[1e-3])]
    assert max(errors) < 1e-5, errors
    # the added loss matters at this tolerance: without it the weights differ
    assert relative(trained[0.0][0], trained[1e-3][0]) > 1e-4


def test_mixed_precision_scales_skips_and_trains_like_one_device_accumulating():
    """mixed_float16 stages: every micro-batch's loss scaled by the same scale,
    the summed gradients unscaled once; a step where any overflowed is skipped
    and the scale halved. The reference: one device running the same float16
    micro-batches with Keras's `LossScaleOptimizer` (4 overflows from 2**22,
    then 16 updates), equal to the last bit on this CPU; the loss history is
    the unscaled loss of each step."""
    keras.utils.set_random_seed(2)
    policy, m = "mixed_float16", 3

    def stage(k, head=False):
        layers = [keras.layers.Dense(16, activation="tanh", name=f"s{k}_a", dtype=policy),
                  keras.layers.Dense(16, name=f"s{k}_b", dtype=policy)]
        return keras.Sequential(layers + ([keras.layers.Dense(D_OUT, name="head")]
                                          if head else []))

    pipeline = Pipeline([stage(0), stage(1, head=True)], devices=_cpus(2), num_microbatches=m,
                        input_shape=(D_IN,), dtype=policy)

    def scaled():
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2),
                                                   initial_scale=2.0 ** 22)

    pipeline.compile(scaled(), "mse")
    with tf.device("/cpu:0"):
        ref = keras.Sequential([keras.Input((D_IN,))] + [
            type(layer).from_config(layer.get_config())
            for stage_ in pipeline.stages for layer in stage_.layers])
    ref.set_weights(pipeline.get_weights())
    x, y = data()
    history = pipeline.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False,
                           verbose=0).history["loss"]

    optimizer, mse, variables = scaled(), keras.losses.MeanSquaredError(), ref.trainable_variables
    losses = []
    for step in list(range(len(x) // BATCH)) * 2:
        xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
        total, step_loss = [tf.zeros_like(v) for v in variables], 0.0
        for part in np.array_split(np.arange(BATCH), m):
            with tf.GradientTape() as tape:
                loss = mse(yb[part], ref(xb[part], training=True)) * (len(part) / BATCH)
                scaled_loss = optimizer.scale_loss(loss)
            total = [a + g for a, g in zip(total, tape.gradient(scaled_loss, variables))]
            step_loss += float(loss)
        optimizer.apply_gradients(zip(total, variables))
        losses.append(step_loss)
    assert float(optimizer.dynamic_scale) == 2.0 ** 18  # four steps overflowed
    assert float(pipeline.optimizer.dynamic_scale) == float(optimizer.dynamic_scale)
    assert int(pipeline.optimizer.iterations) == int(optimizer.iterations) == 16
    np.testing.assert_allclose(history, [np.mean(losses[:10]), np.mean(losses[10:])], rtol=1e-5)
    errors = [relative(a, b) for a, b in zip(pipeline.get_weights(), ref.get_weights())]
    assert max(errors) < 1e-5, errors
    assert {w.dtype for stage_ in pipeline.stages for w in stage_.weights} == {"float32"}
