"""tfdist.distribution.ModelParallel: plain Keras models split by a LayoutMap, exact."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist.distribution as td
from tfdist.internal import keras_initial_slices
from tfdist.testing.collective_log import recorded_all_gathers
from tfdist.testing.equivalence import assert_equivalent
from tfdist.testing.memory import device_bytes

VOCAB, LENGTH, D = 32, 6, 16


def functional_model():
    """Embedding, MultiHeadAttention, LayerNormalization and Dense: plain Keras."""
    ids = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, D, name="token")(ids)
    # No biases: a key bias has an exactly-zero gradient (softmax ignores it), which
    # float noise and Adam turn into steps of the learning rate on any two machines.
    attended = keras.layers.MultiHeadAttention(num_heads=4, key_dim=4, use_bias=False,
                                               name="mha")(x, x)
    x = keras.layers.LayerNormalization(name="ln")(x + attended)
    x = keras.layers.EinsumDense("btd,de->bte", (LENGTH, D), bias_axes="e", name="mix")(x)
    h = keras.layers.Dense(32, activation="relu", name="ffn_up")(x)
    x = x + keras.layers.Dense(D, name="ffn_down")(h)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(ids, keras.layers.Dense(5, name="head")(x))


def functional_layout_map(mesh):
    layout_map = td.LayoutMap(mesh)
    layout_map["token/embeddings"] = ("model", "batch")  # vocabulary split + FSDP
    layout_map["mha/(query|key|value)/kernel"] = (None, "model", None)  # heads
    layout_map["mha/attention_output/kernel"] = ("model", None, "batch")
    layout_map["mix/kernel"] = ("batch", "model")
    layout_map["mix/bias"] = ("model",)
    layout_map["ln/gamma"] = ("model",)  # a layer tfdist does not split: FSDP
    layout_map["ffn_up/kernel"] = ("batch", "model")
    layout_map["ffn_down/kernel"] = ("model", None)
    layout_map["head/kernel"] = ("model",)  # shorter than the rank: (model, None)
    return layout_map


def keras_mesh(shape):
    n = int(np.prod(shape))
    return td.DeviceMesh(shape, ("batch", "model"), [f"cpu:{i}" for i in range(n)])


def data(n=80, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, VOCAB, (n, LENGTH)).astype("int32"),
            rng.integers(0, 5, (n,)).astype("int32"))


# 2x2 with FSDP gathers one layer ahead (prefetch; the default is in test_keras_hub's 2x2).
@pytest.mark.parametrize("shape, prefetch", [((1, 2), False), ((2, 1), False), ((2, 2), True)])
def test_a_functional_keras_model_matches_one_device(shape, prefetch):
    strategy = td.ModelParallel(layout_map=functional_layout_map(keras_mesh(shape)),
                                batch_dim_name="batch", prefetch=prefetch)
    x, y = data()
    report = assert_equivalent(
        functional_model, strategy, x, y, reference=functional_model,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=lambda: keras.optimizers.Adam(1e-2), batch_size=8, steps=10)
    print(shape, "prefetch" if prefetch else "", report)


def test_weights_and_slots_are_stored_one_shard_per_device():
    strategy = td.ModelParallel(layout_map=functional_layout_map(keras_mesh((2, 2))))
    with strategy.scope():
        model = functional_model()
        model.compile(keras.optimizers.Adam(), "mse")
        model.optimizer.build(model.trainable_variables)
    reference = functional_model()
    reference.compile(keras.optimizers.Adam(), "mse")
    reference.optimizer.build(reference.trainable_variables)
    kernel = next(v for v in model.weights if v.path == "token/embeddings")
    assert [tuple(c.shape) for c in kernel.value.values] == [(VOCAB // 2, D // 2)] * 4
    slot = next(v for v in model.optimizer.variables if "token_embeddings" in v.path)
    assert [tuple(c.shape) for c in slot.value.values] == [(VOCAB // 2, D // 2)] * 4
    ln = next(v for v in model.weights if v.path == "ln/gamma")
    assert [tuple(c.shape) for c in ln.value.values] == [(D // 2,)] * 4
    per_device = [device_bytes(model, i) for i in range(4)]
    assert len(set(per_device)) == 1 and per_device[0] < 0.45 * device_bytes(reference)


def test_save_and_load_onto_another_mesh_and_into_plain_keras(tmp_path):
    x, _ = data(16)
    strategy = td.ModelParallel(layout_map=functional_layout_map(keras_mesh((2, 2))))
    with strategy.scope():
        model = functional_model()
    expected = model.predict(x, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    plain = keras.models.load_model(path)
    np.testing.assert_allclose(plain.predict(x, verbose=0), expected, rtol=1e-5, atol=1e-6)
    other = td.ModelParallel(layout_map=functional_layout_map(keras_mesh((1, 4))))
    with other.scope():
        loaded = keras.models.load_model(path)
    shards = next(v for v in loaded.weights if v.path == "ffn_up/kernel").value.values
    assert [tuple(c.shape) for c in shards] == [(D, 8)] * 4
    np.testing.assert_allclose(loaded.predict(x, verbose=0), expected, rtol=1e-5, atol=1e-6)


@keras.saving.register_keras_serializable(package="tfdist_tests")
class Bilinear(keras.layers.Layer):
    """A layer tfdist has never seen: y = x W + x * v."""

    def build(self, input_shape):
        d = input_shape[-1]
        self.w = self.add_weight(name="w", shape=(d, d), initializer="glorot_uniform")
        self.v = self.add_weight(name="v", shape=(d,), initializer="ones")

    def call(self, x):
        return keras.ops.matmul(x, self.w) + x * self.v


def custom_model():
    inputs = keras.Input((D,))
    x = Bilinear(name="custom")(inputs)
    x = keras.layers.Dense(D, activation="tanh", name="dense")(x)
    return keras.Model(inputs, Bilinear(name="custom_out")(x))


@pytest.mark.parametrize("shape", [(1, 4), (2, 2)])
def test_a_custom_layer_trains_exactly_through_fsdp(shape):
    layout_map = td.LayoutMap(keras_mesh(shape))
    layout_map["custom.*/w"] = ("model", "batch")
    layout_map["custom.*/v"] = ("model",)
    strategy = td.ModelParallel(layout_map=layout_map)
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(64, D)).astype("float32"), rng.normal(size=(64, D)).astype("float32")
    assert_equivalent(custom_model, strategy, x, y, reference=custom_model,
                      loss=keras.losses.MeanSquaredError(),
                      optimizer=lambda: keras.optimizers.Adam(1e-2), batch_size=8, steps=8)


class OtherDense(keras.layers.Dense):
    """A Dense subclass: tfdist cannot know its call is Dense's, so it is FSDP."""


def _gathered_shapes(strategy, layer_class):
    """Shapes of every all-gather traced by one training step of a two-layer model."""
    with strategy.scope():
        inputs = keras.Input((12,))
        outputs = layer_class(20, name="up")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(3, name="out")(outputs))
        model.compile(keras.optimizers.SGD(0.1), "mse")
    x = np.ones((16, 12), "float32")
    with recorded_all_gathers(strategy) as shapes:
        model.fit(x, np.ones((16, 3), "float32"), batch_size=16, epochs=1, verbose=0)
    return shapes


def test_a_tensor_parallel_weight_is_never_gathered():
    def strategy():
        layout_map = td.LayoutMap(keras_mesh((1, 2)))
        layout_map["up/kernel"] = (None, "model")  # [12, 20] -> shards [12, 10]
        return td.ModelParallel(layout_map=layout_map)

    shard = (1, 12, 10)  # the backend gathers x[tf.newaxis]
    assert shard in _gathered_shapes(strategy(), OtherDense)  # FSDP gathers it
    tensor_parallel = _gathered_shapes(strategy(), keras.layers.Dense)
    assert tensor_parallel and shard not in tensor_parallel  # only activations move


@pytest.mark.parametrize("key, layout, fragment", [
    ("ffn_up/kernel", ("batch", "model", None),
     "Variable 'ffn_up/kernel' of shape (16, 32): its layout ('batch', 'model', None) "
     "has 3 dimensions, more than the variable's rank 2"),
    ("head/kernel", (None, "model"),
     "Variable 'head/kernel' of shape (16, 5): dimension of size 5 does not divide by "
     "mesh axis 'model' of size 2"),
    ("ffn_up/kernel", ("model", "model"),
     "splits two dimensions over mesh axis 'model'"),
])
def test_bad_layouts_name_the_variable_before_any_step(key, layout, fragment):
    layout_map = td.LayoutMap(keras_mesh((2, 2)))
    layout_map[key] = layout
    with pytest.raises(ValueError) as error:
        strategy = td.ModelParallel(layout_map=layout_map)
        with strategy.scope():
            functional_model()
    assert fragment in str(error.value)


def test_a_path_matching_two_keys_and_a_layout_map_of_another_mesh_are_errors():
    layout_map = td.LayoutMap(keras_mesh((2, 2)))
    layout_map["ffn_up/.*"] = (None, "model")  # (an exact key would win, as in Keras)
    layout_map["ffn.*kernel"] = ("model", None)
    strategy = td.ModelParallel(layout_map=layout_map)
    with pytest.raises(ValueError, match="matches multiple layout specification keys"):
        with strategy.scope():
            functional_model()
    other = td.LayoutMap(keras_mesh((1, 2)))
    other["ffn_up/kernel"] = keras.distribution.TensorLayout((None, "model"),
                                                             keras_mesh((2, 2)))
    with pytest.raises(ValueError, match="build the LayoutMap from the same DeviceMesh"):
        td.ModelParallel(layout_map=other)


def test_keras_distribution_objects_become_tfdist_strategies():
    mesh = keras_mesh((2, 2))
    layout_map = functional_layout_map(mesh)
    strategy = td.from_keras(keras.distribution.ModelParallel(layout_map=layout_map,
                                                              batch_dim_name="batch"))
    assert isinstance(strategy, td.ModelParallel) and strategy.layout_map is layout_map
    assert strategy.mesh.shape.to_string() == "batch:2;model:2"
    data_parallel = td.from_keras(keras.distribution.DataParallel(
        device_mesh=td.DeviceMesh((4,), ("batch",), [f"cpu:{i}" for i in range(4)])))
    assert isinstance(data_parallel, td.DataParallel) and data_parallel.num_replicas_in_sync == 4
    with pytest.raises(ValueError, match="DeviceMesh device 'cpu:99' is not a device"):
        td.ModelParallel(layout_map=td.LayoutMap(td.DeviceMesh((1,), ("batch",), ["cpu:99"])))


class RecordingGlorot(keras.initializers.GlorotUniform):
    """GlorotUniform that records the shapes it is asked for (a custom initializer)."""

    shapes = []

    def __call__(self, shape, dtype=None):
        RecordingGlorot.shapes.append(tuple(shape))
        return super().__call__(shape, dtype=dtype)


def test_weights_and_slots_are_made_shard_by_shard(monkeypatch):
    """Keras's random initializers: each device draws its shard alone, and the shards
    are one device's value for the same seed; a custom initializer draws it whole."""
    layout_map = td.LayoutMap(keras_mesh((1, 4)))
    layout_map["wide/kernel"] = (None, "model")
    layout_map["wide/bias"] = ("model",)
    layout_map["custom/kernel"] = ("model", None)
    strategy = td.ModelParallel(layout_map=layout_map)
    draws = []  # (elements, device) of every raw random draw
    for kind, op in keras_initial_slices._RAW_OPS.items():
        def recording(shape, op=op, **kwargs):
            value = op(shape=shape, **kwargs)
            draws.append((int(np.prod(shape)), value.device))
            return value
        monkeypatch.setitem(keras_initial_slices._RAW_OPS, kind, recording)
    RecordingGlorot.shapes = []
    with strategy.scope():
        layer = keras.layers.Dense(512, kernel_initializer=keras.initializers.GlorotUniform(3),
                                   bias_initializer="ones", name="wide")
        layer.build((None, 256))
        custom = keras.layers.Dense(8, kernel_initializer=RecordingGlorot(seed=4), name="custom")
        custom.build((None, 16))
        optimizer = keras.optimizers.Adam()
        optimizer.build(layer.trainable_variables)
    assert draws and max(n for n, _ in draws) <= 256 * 128, draws  # at most one shard's
    assert {device[-1] for _, device in draws} == {"0", "1", "2", "3"}
    np.testing.assert_array_equal(layer.kernel.numpy(),
                                  keras.initializers.GlorotUniform(3)((256, 512)).numpy())
    assert RecordingGlorot.shapes == [(16, 8)]
    np.testing.assert_array_equal(custom.kernel.numpy(), RecordingGlorot(seed=4)((16, 8)))
    np.testing.assert_array_equal(layer.bias.numpy(), np.ones(512))
    for slot in optimizer.variables[2:]:
        assert [tuple(c.shape) for c in slot.value.values] in ([(256, 128)] * 4, [(128,)] * 4)
        assert not np.any(slot.numpy())


def _fit_both(strategy, optimizer, x, y, batch_size):
    keras.utils.set_random_seed(0)
    reference = functional_model()
    with strategy.scope():
        model = functional_model()
    model.set_weights(reference.get_weights())
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with strategy.scope():
        model.compile(optimizer(), loss)
    reference.compile(optimizer(), loss)
    histories = [m.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0).history["loss"]
                 for m in (model, reference)]
    return model, reference, histories


def test_keras_training_options_and_a_partial_last_batch_match_one_device():
    """global_clipnorm, EMA (with overwrite), gradient accumulation and a 4-row last
    batch together, on TP + FSDP (2x2): weights and every optimizer variable."""
    x, y = data(76)  # 9 batches of 8 and one of 4

    def optimizer():
        return keras.optimizers.Adam(1e-2, global_clipnorm=0.05, use_ema=True,
                                     ema_momentum=0.9, ema_overwrite_frequency=3,
                                     gradient_accumulation_steps=2)

    strategy = td.ModelParallel(layout_map=functional_layout_map(keras_mesh((2, 2))))
    model, reference, (curve, reference_curve) = _fit_both(strategy, optimizer, x, y, 8)
    np.testing.assert_allclose(curve, reference_curve, rtol=1e-5)
    for a, b in zip(model.get_weights() + [v.numpy() for v in model.optimizer.variables],
                    reference.get_weights() + [v.numpy() for v in reference.optimizer.variables]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    # The threshold clips: without it one device trains elsewhere.
    keras.utils.set_random_seed(0)
    unclipped = functional_model()
    unclipped.compile(keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.9,
                                            ema_overwrite_frequency=3,
                                            gradient_accumulation_steps=2),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    unclipped.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert max(np.abs(a - b).max() for a, b in zip(unclipped.get_weights(),
                                                  reference.get_weights())) > 1e-3


def test_mixed_bfloat16_matches_the_single_device_mixed_precision_model(mixed_bfloat16):
    """bfloat16 rounds every partial sum, so the measure is the weights' relative L2
    error (as tests/strategies/test_fit_options.py measures tfdist's own layers)."""
    x, y = data(80)
    strategy = td.ModelParallel(layout_map=functional_layout_map(keras_mesh((2, 2))))
    model, reference, (curve, reference_curve) = _fit_both(
        strategy, lambda: keras.optimizers.Adam(1e-2), x, y, 8)
    assert model.get_layer("ffn_up").compute_dtype == "bfloat16"
    assert next(v for v in model.weights if v.path == "ffn_up/kernel").dtype == "float32"
    a = np.concatenate([w.ravel() for w in model.get_weights()])
    b = np.concatenate([w.ravel() for w in reference.get_weights()])
    weights = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    loss = max(abs(p - q) / abs(q) for p, q in zip(curve, reference_curve))
    print(f"mixed_bfloat16 ModelParallel 2x2: weights {weights:.1e} (relative L2), loss {loss:.1e}")
    assert weights < 2e-2 and loss < 1e-2
