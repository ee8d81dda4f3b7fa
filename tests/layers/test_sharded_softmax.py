"""Extreme-classification head: equivalence with Keras, top-k, no [batch, C] tensor."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.layers import (
    ShardedSoftmax,
    ShardedSparseCategoricalCrossentropy,
    ShardedTopK,
    ShardedTopKAccuracy,
)
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import assert_equivalent
from tfdist.testing.reference import SmoothedSparseCrossentropy

BATCH, D = 24, 8


def _data(num_classes, n, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, D)).astype("float32"),
            rng.integers(0, num_classes, size=(n,)).astype("int32"))


def _builder(num_classes):
    def build():
        inputs = keras.Input((D,))
        h = keras.layers.Dense(D, activation="tanh", name="body")(inputs)
        return keras.Model(inputs, ShardedSoftmax(num_classes, name="head")(h))

    return build


# Every mesh of the issue with C dividing (1000 on 1, 2, 4), not dividing (1001, and
# 1000 on 3) and smaller than the padded shards (10 on 4: 3 columns each, 2 padding).
MESHES = ["data:1;model:1", "data:1;model:2", "data:1;model:4", "data:2;model:2", "data:1;model:3"]
# Every mesh, and every class count (fewer classes than 4 devices' padding, even,
# odd) on some mesh: 7 of the 15 pairs, for the suite's time budget.
GRID = [("data:1;model:1", 1001), ("data:1;model:2", 1000), ("data:1;model:3", 1001),
        ("data:1;model:4", 10), ("data:1;model:4", 1000), ("data:2;model:2", 1000),
        ("data:2;model:2", 1001)]
TOP_K_GRID = [("data:1;model:1", 1001), ("data:1;model:3", 1001), ("data:1;model:4", 10),
              ("data:2;model:2", 1000), ("data:1;model:2", 1001)]


@pytest.mark.parametrize("mesh, num_classes", GRID)
def test_matches_keras_dense_softmax_with_label_smoothing(mesh, num_classes):
    x, y = _data(num_classes, 20 * BATCH)
    report = assert_equivalent(
        _builder(num_classes), MeshStrategy(mesh, "batch:data;classes:model"), x, y,
        loss=ShardedSparseCategoricalCrossentropy(num_classes, label_smoothing=0.1),
        reference_loss=SmoothedSparseCrossentropy(num_classes, label_smoothing=0.1),
        optimizer=lambda: keras.optimizers.Adam(0.01), batch_size=BATCH, steps=20,
        compare_outputs=False, rtol=1e-5)
    print(f"XC {mesh} C={num_classes}: {report}")


@pytest.mark.parametrize("mesh, num_classes", TOP_K_GRID)
def test_sharded_top_k_matches_global_top_k(mesh, num_classes):
    k = 5
    x, _ = _data(num_classes, BATCH, seed=1)
    keras.utils.set_random_seed(0)
    reference = _builder(num_classes)()
    logits = reference.predict(x, verbose=0)
    probs = tf.nn.softmax(logits).numpy()
    strategy = MeshStrategy(mesh, "batch:data;classes:model")
    with strategy.scope():
        trunk = _builder(num_classes)()
        ids, p = ShardedTopK(num_classes, k=k)(trunk.output)
        model = keras.Model(trunk.input, [ids, p])
    model.set_weights(reference.get_weights())
    got_ids, got_probs = model.predict(x, batch_size=BATCH, verbose=0)
    expected_ids = np.argsort(-logits, axis=-1)[:, :k]
    np.testing.assert_array_equal(got_ids, expected_ids)
    np.testing.assert_allclose(got_probs, np.take_along_axis(probs, expected_ids, -1), rtol=1e-5)


def test_top_k_accuracy_metric_and_padding_never_predicted():
    num_classes = 1001
    x, y = _data(num_classes, BATCH)
    strategy = MeshStrategy("data:1;model:4", "classes:model")
    with strategy.scope():
        model = _builder(num_classes)()
        head = model.get_layer("head")
        model.compile(loss=ShardedSparseCategoricalCrossentropy(num_classes),
                      metrics=[ShardedTopKAccuracy(num_classes, k=1),
                               ShardedTopKAccuracy(num_classes, k=5)])
    kernel = head.kernel.numpy()
    # Make the padded columns' would-be logits huge if they were not masked.
    bias = np.zeros(num_classes, "float32")
    bias[y[0]] = 50.0
    head.bias.assign(bias)
    results = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert results["top5_accuracy"] >= results["top1_accuracy"] >= 1 / BATCH
    assert kernel.shape == (D, num_classes)
    assert [tuple(c.shape) for c in head.kernel.value.values] == [(D, 251)] * 4


def test_no_device_holds_a_batch_by_classes_tensor():
    num_classes = 1000  # 250 per device on model:4
    x, y = _data(num_classes, BATCH)
    strategy = MeshStrategy("data:1;model:4", "classes:model")
    with strategy.scope():
        model = _builder(num_classes)()
    loss_fn = ShardedSparseCategoricalCrossentropy(num_classes, label_smoothing=0.1)
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))

    @tf.function
    def step(batch):
        def replica_fn(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            return tape.gradient(loss, [v.value for v in model.trainable_variables])

        return strategy.run(replica_fn, args=batch)

    graph = step.get_concrete_function(next(iter(dataset))).graph
    big = [(op.name, t.shape) for op in graph.get_operations() for t in op.outputs
           if t.shape.rank and any(d is not None and d >= num_classes for d in t.shape)]
    assert big == [], big[:5]


def test_tied_embedding_shares_the_table_and_matches_single_device():
    from tfdist.layers import ShardedEmbedding

    vocab, length = 16, 4

    def build():
        ids = keras.Input((length,), dtype="int32")
        embed = ShardedEmbedding(vocab, D, name="embed")
        h = embed(ids)  # [b, L, D]
        h = keras.layers.Reshape((length * D,))(h)
        h = keras.layers.Dense(D, name="mix")(h)
        logits = ShardedSoftmax(vocab, ("d_model", "vocab"), use_bias=False,
                                tied_embedding=embed, name="head")(h)
        return keras.Model(ids, logits)

    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, size=(10 * BATCH, length)).astype("int32")
    y = x[:, 0]
    strategy = MeshStrategy("data:2;model:2", "batch:data;vocab:model")
    with strategy.scope():
        model = build()
    assert len(model.weights) == 3  # table, mix kernel, mix bias: no separate head kernel

    # Reference: the same computation on one device (tfdist layers off-mesh).
    keras.utils.set_random_seed(0)
    reference = build()
    model.set_weights(reference.get_weights())
    for m in (model, reference):
        with (strategy.scope() if m is model else tf.distribute.get_strategy().scope()):
            m.compile(keras.optimizers.Adam(0.01), ShardedSparseCategoricalCrossentropy(
                vocab, class_axis="vocab"))
        m.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh, num_classes", [("data:1;model:1", 1001), ("data:1;model:3", 1001),
                                               ("data:2;model:2", 1000)])
def test_class_centre_sampling_keeps_positives_and_is_the_softmax_over_the_sample(
        mesh, num_classes, monkeypatch):
    from tfdist.layers import sharded_softmax

    rate, smoothing = 0.05, 0.1
    x, y = _data(num_classes, BATCH, seed=2)
    strategy = MeshStrategy(mesh, "batch:data;classes:model")
    with strategy.scope():
        head = ShardedSoftmax(num_classes, sample_rate=rate, label_smoothing=smoothing, name="head")
        head(x[:1])
    sampled = []  # the ids each replica's call draws, in trace order
    draw = sharded_softmax.sample_classes
    monkeypatch.setattr(sharded_softmax, "sample_classes",
                        lambda *a: sampled.append(draw(*a)) or sampled[-1])
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors((x, y)))

    @tf.function
    def step(batch):
        def replica_fn(xb, yb):
            logits = head(xb, labels=yb, training=True)
            return logits, head.losses[-1], sampled[-1]

        return strategy.run(replica_fn, args=batch)

    logits, losses, ids = (strategy.experimental_local_results(t) for t in step(next(iter(dataset))))
    full = x @ head.kernel.numpy() + head.bias.numpy()  # [BATCH, C], global
    shape = strategy.mesh.shape
    local = -(-num_classes // shape.axis_size("model"))
    rows = BATCH // shape.axis_size("data")  # rows per data group (the gathered rows)
    own = BATCH // shape.size
    for replica in range(shape.size):
        coords = shape.coordinates(replica)
        first = coords["model"] * local
        kept = first + ids[replica].numpy()  # global ids of this shard's sample
        group_rows = slice(coords["data"] * rows, (coords["data"] + 1) * rows)
        real = min(local, num_classes - first)
        positives = {c for c in y[group_rows] if first <= c < first + local}
        assert positives <= set(kept) and kept.max() < num_classes
        assert len(kept) == max(int(np.ceil(rate * real)), len(positives))
        # Compact logits: only the sampled columns were computed.
        np.testing.assert_allclose(logits[replica].numpy(), full[group_rows][:, kept],
                                   rtol=1e-5, atol=1e-6)
        # The added loss: mean over the replica's rows of the smoothed softmax
        # cross-entropy over the union of its data group's samples.
        group = [r for r in range(shape.size) if shape.coordinates(r)["data"] == coords["data"]]
        sample = np.concatenate([shape.coordinates(r)["model"] * local + ids[r].numpy()
                                 for r in group])
        mine = slice(replica * own, (replica + 1) * own)
        z = full[mine][:, sample]
        lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
        target = np.take_along_axis(z, np.searchsorted(sample, y[mine])[:, None], -1)[:, 0]
        expected = (1 - smoothing) * (lse - target) + smoothing * (lse - z.mean(-1))
        np.testing.assert_allclose(losses[replica].numpy(), expected.mean(), rtol=1e-5)


def test_sampled_training_with_every_class_kept_matches_full_softmax():
    num_classes = 50  # sample_rate 0.999 keeps every class: the sampled path must equal the full one
    x, y = _data(num_classes, 10 * BATCH)
    strategy = MeshStrategy("data:2;model:2", "batch:data;classes:model")
    models = []
    for rate in (1.0, 0.999):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            inputs, labels = keras.Input((D,)), keras.Input((), dtype="int32")
            h = keras.layers.Dense(D, activation="tanh", name="body")(inputs)
            head = ShardedSoftmax(num_classes, sample_rate=rate, label_smoothing=0.1, name="head")
            if rate == 1.0:
                model = keras.Model(inputs, head(h))
                model.compile(keras.optimizers.Adam(0.01),
                              ShardedSparseCategoricalCrossentropy(num_classes, label_smoothing=0.1))
                model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
            else:
                model = keras.Model([inputs, labels], head(h, labels=labels))
                model.compile(keras.optimizers.Adam(0.01), loss=None)
                model.fit((x, y), y, batch_size=BATCH, shuffle=False, verbose=0)
        models.append(model)
    for a, b in zip(models[0].get_weights(), models[1].get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_sampling_applies_to_training_with_labels_only():
    num_classes = 50
    x, y = _data(num_classes, 4)
    head = ShardedSoftmax(num_classes, sample_rate=0.1)
    assert head(x).shape == (4, num_classes) and not head.losses
    assert head(x, labels=y).shape == (4, num_classes)  # training=None: inference
    sampled = head(x, labels=y, training=True)
    assert sampled.shape[1] < num_classes and len(head.losses) == 1
    assert ShardedSoftmax.from_config(head.get_config()).sample_rate == 0.1
    with pytest.raises(ValueError, match=r"`sample_rate` must be in \(0, 1\]. Received: sample_rate=0"):
        ShardedSoftmax(num_classes, sample_rate=0)


@pytest.mark.parametrize("strategy_name", ["mirrored", "averaging"])
def test_the_sharded_loss_under_other_strategies_matches_one_device(strategy_name):
    """Outside a tfdist mesh the head is one dense softmax and its loss Keras's reduction."""
    from tfdist.strategies import get_strategy

    cpus = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    # MirroredStrategy through one device: TF's collectives would share instance keys
    # with any other MirroredStrategy of this test process.
    strategy = (tf.distribute.MirroredStrategy(cpus, tf.distribute.ReductionToOneDevice())
                if strategy_name == "mirrored"
                else get_strategy("averaging", period=1, devices=cpus))
    x, y = _data(1001, 8 * BATCH)
    report = assert_equivalent(
        _builder(1001), strategy, x, y,
        loss=ShardedSparseCategoricalCrossentropy(1001, label_smoothing=0.1),
        reference_loss=SmoothedSparseCrossentropy(1001, label_smoothing=0.1),
        optimizer=lambda: keras.optimizers.SGD(0.5), batch_size=BATCH, steps=8,
        compare_outputs=False, rtol=1e-5)
    print(f"XC loss under {strategy_name}: {report}")
