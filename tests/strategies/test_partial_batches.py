"""Batches of any shape on a mesh: several lengths in one fit, partial batches, failures.

Every test compares with the single-device Keras twin (`reference_layer`,
which shares no code with the sharded layers) on the same batches: history,
evaluation, predictions (all rows, in order) and weights. The model has
every kind of sharded layer whose collectives see the batch: ShardedEmbedding,
column/row ShardedDense, two MoE layers (their hidden units or their experts
split; two, because replicas' run-time checks in two MoE layers once waited on
each other's all-to-alls) and a ShardedSoftmax over 13 classes (padded shards). The MoE has room for every
token and no auxiliary losses: its routing then does not depend on how tokens
are grouped, so one device and every mesh route alike, and its reference is
every expert on every token mixed by the gates (`NoDropReferenceMoE`).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.layers import (MoE, ShardedDense, ShardedEmbedding, ShardedSoftmax,
                           ShardedSparseCategoricalCrossentropy, ShardedTopK,
                           ShardedTopKAccuracy)
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import max_rel_diff
from tfdist.testing.moe_reference import NoDropReferenceMoE
from tfdist.testing.reference import reference_layer

VOCAB, CLASSES = 16, 13
LAYOUTS = {  # the MoE's hidden units split on 2x2, its experts on 1x4
    "data:2;model:2": "batch:data;d_ff:model;vocab:model;classes:model",
    "data:1;model:4": "batch:data;vocab:model;experts:model;classes:model",
}


def build():
    ids = keras.Input((None,), dtype="int32", name="ids")
    h = ShardedEmbedding(VOCAB, 8, name="embed")(ids)
    f = ShardedDense(16, ("d_model", "d_ff"), activation="relu", output_sharded=True,
                     name="ffn_in")(h)
    h = h + ShardedDense(8, ("d_ff", "d_model"), input_sharded=True, name="ffn_out")(f)
    for name in ("moe", "moe_2"):  # two MoE layers: once a deadlock on unknown lengths
        h = h + MoE(4, 8, top_k=2, group_size=2, capacity_factor=4.0, eval_capacity_factor=4.0,
                    min_capacity=4, aux_loss_coef=0.0, z_loss_coef=0.0, name=name)(h)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(ids, ShardedSoftmax(CLASSES, name="classes")(pooled), name="rows_model")


def twin(model):
    """The single-device Keras twin, with the no-drop MoE reference."""
    def clone(layer):
        if isinstance(layer, MoE):
            return NoDropReferenceMoE.from_config(layer.get_config())
        return reference_layer(layer)

    reference = keras.models.clone_model(model, clone_function=clone)
    reference.set_weights(model.get_weights())
    return reference


def batch(rows, length, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, size=(rows, length)).astype("int32")
    return x, (x.sum(axis=1) % CLASSES).astype("int32")


def dataset(lengths, rows=8):
    parts = [tf.data.Dataset.from_tensors(batch(rows, n, seed)) for seed, n in enumerate(lengths)]
    out = parts[0]
    for part in parts[1:]:
        out = out.concatenate(part)
    return out


def models(strategy, **compile_args):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build()
    reference = twin(model)

    def compile(m, loss, accuracy):
        m.compile(keras.optimizers.SGD(0.1, momentum=0.9), loss,
                  metrics=[accuracy(name="acc")], weighted_metrics=[accuracy(name="w_acc")],
                  **compile_args)

    with strategy.scope():
        compile(model, ShardedSparseCategoricalCrossentropy(CLASSES),
                lambda name: ShardedTopKAccuracy(CLASSES, k=1, name=name))
    compile(reference, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            lambda name: keras.metrics.SparseTopKCategoricalAccuracy(k=1, name=name))
    return model, reference


def assert_same_predictions(strategy, model, reference, x, batch_size):
    """Top-3 classes and probabilities of every row, in order (the logits are shards)."""
    with strategy.scope():
        top = keras.Model(model.inputs, ShardedTopK(CLASSES, k=3)(model.outputs[0]))
    ids, probs = top.predict(x, batch_size=batch_size, verbose=0)
    ref_probs, ref_ids = tf.math.top_k(tf.nn.softmax(
        reference.predict(x, batch_size=batch_size, verbose=0)), k=3)
    assert ids.shape == (len(x), 3)
    np.testing.assert_array_equal(ids, ref_ids.numpy())
    assert max_rel_diff(probs, ref_probs.numpy()) < 1e-5


def assert_same(model, reference, history, ref_history, rtol=1e-5):
    """Same history (the MoE's own metrics aside: nothing dropped) and weights."""
    assert set(ref_history.history) <= set(history.history)
    assert max(history.history["moe_dropped"] + history.history["moe_2_dropped"]) == 0.0
    for key, values in ref_history.history.items():
        assert max_rel_diff(history.history[key], values) < rtol, (
            key, history.history[key], values)
    weights = [max_rel_diff(a, b) for a, b in zip(model.get_weights(), reference.get_weights())]
    assert max(weights) < rtol, weights
    return max(weights)


@pytest.mark.parametrize("mesh", ["data:1;model:4"])  # 2x2's partial batches: the next test
def test_three_lengths_in_one_fit_match_one_device(mesh):
    strategy = MeshStrategy(mesh, LAYOUTS[mesh])
    model, reference = models(strategy)
    lengths = [4, 6, 8, 6, 4, 8]
    history = model.fit(dataset(lengths), epochs=2, verbose=0)
    ref_history = reference.fit(dataset(lengths), epochs=2, verbose=0)
    print(f"three lengths on {mesh}: weights {assert_same(model, reference, history, ref_history)}")
    evaluation = model.evaluate(dataset(lengths), verbose=0, return_dict=True)
    ref_evaluation = reference.evaluate(dataset(lengths), verbose=0, return_dict=True)
    assert max_rel_diff([evaluation[k] for k in ref_evaluation], list(ref_evaluation.values())) < 1e-5
    # One shape id per (traced step, shape), plus a count per traced step: 3 for
    # fit (whose epochs share one trace), 3 for evaluate.
    assert strategy.backend._shape_ids.size().numpy() == (3 + 1) + (3 + 1)


@pytest.mark.parametrize("mesh, batch_size", [("data:2;model:2", 8), ("data:1;model:4", 10)])
def test_partial_batches_use_every_row_like_one_device(mesh, batch_size):
    """37 rows: a last batch of 5 (2x2: replicas of 2, 2, 1 and 0 rows) or batches of
    10 that 4 replicas cannot share (3, 3, 2, 2; the last of 7 rows: 2, 2, 2, 1)."""
    strategy = MeshStrategy(mesh, LAYOUTS[mesh])
    model, reference = models(strategy)
    x, y = batch(37, 6, seed=3)
    weights = np.random.default_rng(4).uniform(0.5, 2.0, size=37).astype("float32")
    args = dict(batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    history = model.fit(x, y, sample_weight=weights, **args)
    ref_history = reference.fit(x, y, sample_weight=weights, **args)
    err = assert_same(model, reference, history, ref_history)
    evaluation = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    ref_evaluation = reference.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    assert evaluation["moe_dropped"] == 0.0
    for key, value in ref_evaluation.items():
        assert abs(evaluation[key] - value) <= 1e-5 * abs(value), (key, evaluation, ref_evaluation)
    assert_same_predictions(strategy, model, reference, x, batch_size)
    print(f"37 rows, batch {batch_size}, {mesh}: weights {err}, evaluation {evaluation}")


def test_steps_per_execution_over_alternating_lengths_matches_one_device():
    """Inside one `steps_per_execution` loop every iteration draws its own shape id."""
    strategy = MeshStrategy("data:2;model:2", LAYOUTS["data:2;model:2"])
    model, reference = models(strategy, steps_per_execution=4)
    lengths = [4, 6] * 4
    history = model.fit(dataset(lengths), epochs=2, verbose=0)
    ref_history = reference.fit(dataset(lengths), epochs=2, verbose=0)
    assert_same(model, reference, history, ref_history)


class Checked(keras.layers.Layer):
    """Passes `h` on; fails the replica whose ids hold the last token id."""

    def call(self, inputs):
        h, ids = inputs
        tf.debugging.assert_less(tf.reduce_max(ids), VOCAB - 1, message="bad token")
        return h

    def compute_output_shape(self, input_shape):
        return input_shape[0]


def test_a_failed_step_leaves_the_next_steps_keys_agreeing():
    """One replica fails in the middle of a step (after collectives): later steps, of
    a new shape and of the old one, pair up and train like one device."""
    def build_checked():
        ids = keras.Input((None,), dtype="int32")
        h = ShardedEmbedding(VOCAB, 8, name="embed")(ids)
        f = ShardedDense(16, ("d_model", "d_ff"), activation="relu", output_sharded=True,
                         name="a")(h)
        h = h + ShardedDense(8, ("d_ff", "d_model"), input_sharded=True, name="b")(f)

        h = Checked(name="check")([h, ids])
        f = ShardedDense(16, ("d_model", "d_ff"), activation="relu", output_sharded=True,
                         name="c")(h)
        h = h + ShardedDense(8, ("d_ff", "d_model"), input_sharded=True, name="d")(f)
        return keras.Model(ids, ShardedDense(VOCAB, ("d_model", "vocab"), name="logits")(h))

    strategy = MeshStrategy("data:2;model:2", "batch:data;d_ff:model;vocab:model")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = build_checked()
    reference = twin(model)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with strategy.scope():
        model.compile(keras.optimizers.SGD(0.1), loss)
    reference.compile(keras.optimizers.SGD(0.1), loss)
    rng = np.random.default_rng(0)
    good = [rng.integers(0, VOCAB - 1, size=(8, n)).astype("int32") for n in (4, 6)]
    model.fit(good[0], good[0], batch_size=8, verbose=0)
    reference.fit(good[0], good[0], batch_size=8, verbose=0)
    bad = rng.integers(0, VOCAB - 1, size=(8, 5)).astype("int32")
    bad[7, 0] = VOCAB - 1  # a row of the last replica only
    with pytest.raises(tf.errors.InvalidArgumentError, match="bad token"):
        model.fit(bad, bad, batch_size=8, verbose=0)
    for x in (good[1], good[0]):
        model.fit(x, x, batch_size=8, verbose=0)
        reference.fit(x, x, batch_size=8, verbose=0)
    assert max(max_rel_diff(a, b) for a, b in zip(model.get_weights(),
                                                  reference.get_weights())) < 1e-5


def test_more_shapes_than_max_shapes_fail_naming_the_limit():
    strategy = MeshStrategy("data:2;model:2", LAYOUTS["data:2;model:2"], max_shapes=2)
    model, _ = models(strategy)
    model.fit(dataset([4, 6, 4]), verbose=0)
    with pytest.raises(tf.errors.InvalidArgumentError, match="more than 2 distinct input shapes"):
        model.fit(dataset([8]), verbose=0)
