"""Equivalence cases shared by the multi-process jobs (mesh over workers, over Horovod ranks).

Each runs `assert_equivalent` (6 optimizer steps, rtol 1e-5: accumulation of 2
and EMA overwrite every 3 act twice; 10 steps in the in-process tests) for one
model on the given strategy and returns the report.
"""

import keras
import numpy as np

from tfdist.layers import ShardedSoftmax, ShardedSparseCategoricalCrossentropy
from tfdist.models import build_token_mlp, make_copy_task
from tfdist.testing.equivalence import assert_equivalent
from tfdist.testing.reference import SmoothedSparseCrossentropy, reference_model


STEPS = 6


def adam():
    return keras.optimizers.Adam(0.01)


def token_mlp(strategy):
    """ShardedEmbedding and column/row ShardedDense (the token model)."""
    x, y = make_copy_task(STEPS * 16)
    return assert_equivalent(
        build_token_mlp, strategy, x, y,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=adam, batch_size=16, steps=STEPS, rtol=1e-5)


def remat(strategy):
    """The token model with every layer recomputed (built under `keras.RematScope`): the
    collectives run again in the backward pass; equals one device keeping activations."""
    def build():
        with keras.RematScope(mode="full"):
            return build_token_mlp()

    x, y = make_copy_task(STEPS * 16)
    return assert_equivalent(
        build, strategy, x, y,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=adam, batch_size=16, steps=STEPS, rtol=1e-5,
        reference=lambda: reference_model(build_token_mlp()))


def plain_embedding(strategy):
    """The token model with a replicated keras.layers.Embedding (sparse gradient), clipped."""
    x, y = make_copy_task(STEPS * 16)
    return assert_equivalent(
        lambda: build_token_mlp(plain_embedding=True), strategy, x, y,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.1),
        batch_size=16, steps=STEPS, rtol=1e-5)


def keras_mlp():
    """A plain Keras model of the copy task: Embedding, LayerNormalization, two Dense."""
    ids = keras.Input((4,), dtype="int32")
    x = keras.layers.Embedding(16, 8)(ids)
    x = keras.layers.LayerNormalization()(x)
    h = keras.layers.Dense(32, activation="relu")(x)
    return keras.Model(ids, keras.layers.Dense(16)(h))


def zero(strategy, zero_strategy_for=None, stages=(1, 2)):
    """ZeRO-1 and ZeRO-2 over the strategy's devices (data parallel, `zero_stage`): a plain
    Keras model with clipping, Adam's slots (and for stage 2 the gradients) split over
    every device. `zero_strategy_for(stage)` builds the data-parallel strategy (default:
    `DataParallel` over the strategy's devices)."""
    import tfdist.distribution as td

    if zero_strategy_for is None:
        def zero_strategy_for(stage):
            return td.DataParallel(devices=list(strategy.extended.worker_devices),
                                   zero_stage=stage)

    reports = []
    for stage in stages:
        zero_strategy = zero_strategy_for(stage)
        x, y = make_copy_task(STEPS * 16)
        reports.append(f"stage {stage}: " + str(assert_equivalent(
            keras_mlp, zero_strategy, x, y, reference=keras_mlp,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            optimizer=lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.5),
            batch_size=16, steps=STEPS, rtol=1e-5)))
        with zero_strategy.scope():
            model = keras_mlp()
        n = zero_strategy.num_replicas_in_sync
        kernel = model.layers[-1].kernel.value  # (32, 16), split on dimension 0
        assert [tuple(c.shape) for c in kernel.values] == [(32 // n, 16)] * len(kernel.values)
    return "; ".join(reports)


def keras_hub_causal_lm(strategy):
    """keras-hub's `GemmaCausalLM` with its preprocessor, built under the scope, on raw
    strings (`fit`, `evaluate`, `predict`, greedy `generate`): `ModelParallel` with Gemma's
    layout map, its model axis over the strategy's devices, against one device
    (tests/distribution/test_keras_hub_tasks.py)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__))), "distribution"))
    import test_keras_hub_tasks as tasks

    devices = list(strategy.extended.worker_devices)
    reference = tasks.run_reference()
    return tasks.assert_matches_one_device(
        tasks.gemma_model_parallel((1, len(devices)), devices), reference)


def keras_options(strategy):
    """Keras's conditional updates together: accumulation, EMA overwrite, decay, clipping."""
    x, y = make_copy_task(STEPS * 16)
    return assert_equivalent(
        build_token_mlp, strategy, x, y,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=lambda: keras.optimizers.SGD(
            0.5, momentum=0.9, weight_decay=0.01, global_clipnorm=0.1,
            gradient_accumulation_steps=2, use_ema=True, ema_overwrite_frequency=3),
        batch_size=16, steps=STEPS, rtol=1e-5)


def sharded_options(strategy):
    """Lamb, L1/L2 penalties and per-shard constraints on sharded weights."""
    from tfdist.layers import ShardedDense, ShardedEmbedding

    R, C = keras.regularizers, keras.constraints

    def build():
        ids = keras.Input((4,), dtype="int32")
        h = ShardedEmbedding(16, 8, embeddings_regularizer=R.L2(1e-2), name="embed")(ids)
        f = ShardedDense(32, ("d_model", "d_ff"), activation="relu", output_sharded=True,
                         kernel_regularizer=R.L1L2(1e-3, 1e-2),
                         kernel_constraint=C.MaxNorm(0.3, axis=0), name="ffn_in")(h)
        h = h + ShardedDense(8, ("d_ff", "d_model"), input_sharded=True,
                             kernel_constraint=C.NonNeg(), name="ffn_out")(f)
        return keras.Model(ids, ShardedDense(16, ("d_model", "vocab"), name="logits")(h))

    x, y = make_copy_task(STEPS * 16)
    return assert_equivalent(
        build, strategy, x, y, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=lambda: keras.optimizers.Lamb(0.01), batch_size=16, steps=STEPS, rtol=1e-5)


def fit_options(strategy):
    """sample_weight, validation_data and steps_per_execution: one device's history and weights."""
    from tfdist.testing.equivalence import max_rel_diff
    from tfdist.testing.reference import reference_model

    x, y = make_copy_task(8 * 16)
    vx, vy = make_copy_task(2 * 16, seed=5)
    weights = np.random.default_rng(1).uniform(0.0, 2.0, size=y.shape).astype("float32")
    keras.utils.set_random_seed(0)
    reference = reference_model(build_token_mlp())
    with strategy.scope():
        model = build_token_mlp()
        model.compile(adam(), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      weighted_metrics=["sparse_categorical_accuracy"], steps_per_execution=3)
    model.set_weights(reference.get_weights())
    reference.compile(adam(), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      weighted_metrics=["sparse_categorical_accuracy"], steps_per_execution=3)
    args = dict(sample_weight=weights, batch_size=16, epochs=2, shuffle=False, verbose=0,
                validation_data=(vx, vy))
    history, ref_history = model.fit(x, y, **args).history, reference.fit(x, y, **args).history
    assert sorted(history) == sorted(ref_history), (history, ref_history)
    worst_history = max(max_rel_diff(history[k], ref_history[k]) for k in ref_history)
    worst_weights = max(max_rel_diff(a, b) for a, b in zip(model.get_weights(),
                                                           reference.get_weights()))
    assert max(worst_history, worst_weights) < 1e-5, (worst_history, worst_weights)
    return (f"history ({', '.join(sorted(ref_history))}) {worst_history:.1e}, "
            f"weights after 16 steps {worst_weights:.1e}")


def mixed_bfloat16(strategy):
    """The token model under mixed_bfloat16 against the single-device mixed-precision one.

    Returns the weights' relative L2 error after 10 Adam steps (bfloat16 rounds
    every partial sum: see tests/strategies/test_fit_options.py), asserted < 2e-2.
    """
    from tfdist.testing.reference import reference_model

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        x, y = make_copy_task(10 * 16)
        keras.utils.set_random_seed(0)
        reference = reference_model(build_token_mlp())
        with strategy.scope():
            model = build_token_mlp()
            model.compile(adam(), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.set_weights(reference.get_weights())
        reference.compile(adam(), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        a = np.concatenate([w.ravel() for w in model.get_weights()])
        b = np.concatenate([w.ravel() for w in reference.get_weights()])
        error = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert error < 2e-2, error
    return f"weights after 10 steps {error:.1e} (relative L2)"


def xc_head(strategy, num_classes=1001):
    """ShardedSoftmax with label smoothing, C not divisible by the shards."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * 16, 8)).astype("float32")
    y = rng.integers(0, num_classes, STEPS * 16).astype("int32")

    def head():
        inputs = keras.Input((8,))
        return keras.Model(inputs, ShardedSoftmax(num_classes, name="head")(inputs))

    return assert_equivalent(
        head, strategy, x, y,
        loss=ShardedSparseCategoricalCrossentropy(num_classes, label_smoothing=0.1),
        reference_loss=SmoothedSparseCrossentropy(num_classes, label_smoothing=0.1),
        optimizer=adam, batch_size=16, steps=STEPS, compare_outputs=False, rtol=1e-5)


def partial_batches(strategy):
    """37 rows, batch 8: fit, evaluate and predict use every row once, like one device
    (and evaluate in batches of 12, whose last row leaves some replicas without rows)."""
    from tfdist.testing.equivalence import max_rel_diff
    from tfdist.testing.reference import reference_model

    x, y = make_copy_task(37)
    weights = np.random.default_rng(2).uniform(0.5, 2.0, size=y.shape).astype("float32")
    keras.utils.set_random_seed(0)
    reference = reference_model(build_token_mlp())
    with strategy.scope():
        model = build_token_mlp()
    model.set_weights(reference.get_weights())

    def compile(m):
        m.compile(keras.optimizers.SGD(0.2, momentum=0.9),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["sparse_categorical_accuracy"],
                  weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="w_acc")])

    with strategy.scope():
        compile(model)
    compile(reference)
    args = dict(batch_size=8, epochs=2, shuffle=False, verbose=0)
    history = model.fit(x, y, sample_weight=weights, **args).history
    ref_history = reference.fit(x, y, sample_weight=weights, **args).history
    worst_history = max(max_rel_diff(history[k], ref_history[k]) for k in ref_history)
    worst_weights = max(max_rel_diff(a, b) for a, b in zip(model.get_weights(),
                                                           reference.get_weights()))
    evaluation = model.evaluate(x, y, batch_size=8, verbose=0)
    worst_evaluation = max_rel_diff(evaluation, reference.evaluate(x, y, batch_size=8, verbose=0))
    # Batch 12: the last batch is one row, so some replicas hold none.
    one_row = model.evaluate(x, y, sample_weight=weights, batch_size=12, verbose=0)
    worst_evaluation = max(worst_evaluation, max_rel_diff(one_row, reference.evaluate(
        x, y, sample_weight=weights, batch_size=12, verbose=0)))
    predictions = model.predict(x, batch_size=8, verbose=0)
    assert predictions.shape == (37, 4, 16), predictions.shape
    worst_predictions = max_rel_diff(predictions, reference.predict(x, batch_size=8, verbose=0))
    worst = max(worst_history, worst_weights, worst_evaluation, worst_predictions)
    assert worst < 1e-5, (worst_history, worst_weights, worst_evaluation, worst_predictions)
    return (f"37 rows, batch 8: history {worst_history:.1e}, weights after 10 steps {worst_weights:.1e}, "
            f"evaluate {worst_evaluation:.1e}, predict (37 rows) {worst_predictions:.1e}")


def sharded_checkpoint(strategy):
    """A sharded save: each worker writes the shards on its devices; a plain model reads it."""
    import os
    import tempfile

    from tfdist import checkpoint

    x, y = make_copy_task(STEPS * 16)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_token_mlp()
        model.compile(adam(), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    path = os.path.join(tempfile.mkdtemp(), "model.shards")
    checkpoint.save(model, path)
    (generation,) = os.listdir(path)
    files = sorted(os.listdir(os.path.join(path, generation)))
    hosts = {d.split("/device")[0] for d in strategy.extended.worker_devices}
    assert files == ["ckpt.data-%05d-of-%05d" % (k, len(hosts)) for k in range(len(hosts))] \
        + ["ckpt.index"], files  # one part per worker host, each written there
    diff = plain_token_mlp_diff(path, training_state(model))
    assert diff == 0.0, diff
    return (f"weights after {STEPS} steps and Adam state saved by {len(hosts)} worker hosts, "
            f"read by a plain model: diff {diff}")


def training_state(model):
    """Weights and optimizer variables as numpy arrays (a global read: every rank calls it)."""
    return model.get_weights() + [v.numpy() for v in model.optimizer.variables]


def plain_token_mlp_diff(path, state) -> float:
    """The largest difference between `state` and a plain token MLP + Adam loaded from `path`."""
    from tfdist import checkpoint

    plain = build_token_mlp()
    plain.compile(adam(), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    plain.optimizer.build(plain.trainable_variables)
    checkpoint.load(plain, path)
    return max(float(np.abs(a - b).max()) for a, b in zip(training_state(plain), state))


def pipeline(strategy):
    """Pipeline stages on the strategy's devices (one per process over TF_CONFIG
    workers: the activations and their gradients cross processes), GPipe and
    1F1B, against one device accumulating the same batch (tfdist.testing.pipeline)."""
    from tfdist.pipeline.model import Pipeline
    from tfdist.testing import pipeline as cases

    devices = list(strategy.devices)
    reports = []
    for schedule, m in (("gpipe", 2), ("1f1b", 5)):
        keras.utils.set_random_seed(m)
        model = Pipeline(cases.stages(len(devices)), devices=devices, schedule=schedule,
                         num_microbatches=m, input_shape=(cases.D_IN,))
        for k, stage in enumerate(model.stages):
            assert {w.value.device for w in stage.weights} == {devices[k]}, k
        report = cases.assert_matches_one_device(model, cases.reference(model))
        reports.append(f"{schedule} p={len(devices)} m={m}: {report}")
    return "; ".join(reports)


def sequence(strategy):
    """The causal LM with `length` split over every device of the strategy (a new
    strategy of the same kind on the same devices, mesh `seq:N`, `length:seq`): ring and
    Ulysses attention, 10 Adam steps, loss history and weights against one device."""
    from tfdist.testing import causal_lm

    n = strategy.mesh.size
    if type(strategy).__name__ == "HorovodStrategy":
        seq = type(strategy)(mesh_shape=f"seq:{n}", layout="length:seq")
    else:
        seq = type(strategy)(f"seq:{n}", "length:seq",
                             devices=list(strategy.extended.worker_devices))
    want = causal_lm.train(None)
    reports = []
    for method in ("ring", "ulysses"):
        loss, weights = causal_lm.compare(causal_lm.train(seq, method), want)
        assert loss < 1e-5 and weights < 1e-5, (method, loss, weights)
        reports.append(f"{method} loss {loss:.1e} weights after 10 steps {weights:.1e}")
    return "; ".join(reports)
