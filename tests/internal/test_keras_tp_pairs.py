"""tfdist.internal.keras_tp_pairs: Megatron pairing of feed-forward blocks, exact and checked."""

import contextlib
import inspect

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

import tfdist.distribution as td
from tfdist.internal import keras_tensor_parallel, keras_tp_pairs
from tfdist.testing.collective_log import recorded
from tfdist.testing.equivalence import assert_equivalent

# What each entry relies on, as the installed keras-hub writes the block's call: the
# column layers read one input, only element-wise ops lie between them and the row layer.
BLOCK_LINES = {
    "GemmaDecoderBlock": [
        "x1 = self.gating_ffw(normalized_x)",
        "x2 = self.gating_ffw_2(normalized_x)",
        "x = keras.activations.gelu(x1, approximate=True) * x2",
        "x = self.ffw_linear(x)",
    ],
    "LlamaTransformerDecoder": [
        "gate_output = self._feedforward_gate_dense(x)",
        'gate_output = ops.cast(gate_output, "float32")',
        "gate_output = self.activation(gate_output)",
        "gate_output = ops.cast(gate_output, self.compute_dtype)",
        "x = self._feedforward_intermediate_dense(x)",
        "x = self._feedforward_output_dense(ops.multiply(x, gate_output))",
    ],
}


def _source_lines(cls):
    call = cls.__dict__["call"]
    source = inspect.getsource(getattr(call, "_tfdist_original", call))
    return [line.strip() for line in source.splitlines()]


def test_each_entry_is_a_block_of_the_installed_keras_hub():
    classes = keras_tp_pairs.block_classes()
    assert sorted(cls.__name__ for cls in classes) == sorted(BLOCK_LINES)
    for cls in classes:
        lines = _source_lines(cls)
        positions = [lines.index(line) for line in BLOCK_LINES[cls.__name__]]
        assert positions == sorted(positions), cls.__name__  # in this order
        # Nothing else reads the columns' outputs between the first and the row layer.
        between = lines[positions[0]:positions[-1] + 1]
        assert [line for line in between if line and not line.startswith("#")] == \
            BLOCK_LINES[cls.__name__], cls.__name__


def _mesh(shape):
    n = int(np.prod(shape))
    return td.DeviceMesh(shape, ("batch", "model"), [f"cpu:{i}" for i in range(n)])


D_FF = 24  # per device on "model:2": 12, no other dimension of the models below


def _gemma():
    return keras_hub.models.GemmaBackbone(
        vocabulary_size=32, num_layers=1, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=2 * D_FF, head_dim=4)  # Gemma's d_ff: half of it


def _llama():
    return keras_hub.models.LlamaBackbone(
        vocabulary_size=32, num_layers=1, num_query_heads=4, num_key_value_heads=2,
        hidden_dim=16, intermediate_dim=D_FF)


def _exchanged(make, shape=(1, 2)):
    """Shapes all-to-all'd in one traced step of backbone `make()` on a `shape` mesh."""
    strategy = td.ModelParallel(layout_map=type(make()).get_layout_map(_mesh(shape)),
                                batch_dim_name="batch")
    with strategy.scope():
        model = make()
        model.compile("adam", "mse")
    x = {"token_ids": np.ones((8, 6), "int32"), "padding_mask": np.ones((8, 6), "int32")}
    with recorded(strategy, "all_to_all") as shapes:
        model.fit(x, np.zeros((8, 6, 16), "float32"), batch_size=8, verbose=0)
    return shapes


@pytest.mark.parametrize("make", [_gemma, _llama], ids=["gemma", "llama"])
def test_gate_and_up_hand_their_local_columns_straight_to_down(make):
    # Unpaired, gate and up all-to-all [2, b, t, d_ff/2] back to whole rows and down
    # all-to-alls them into columns again (forward and backward); paired, none moves.
    # test_keras_hub checks the paired blocks against one device.
    shapes = _exchanged(make)
    assert shapes and all(s[-1] != D_FF // 2 for s in shapes), shapes


class Block(keras.layers.Layer):
    """gate/up column layers and a down row layer, with `between` applied in between."""

    def __init__(self, between, **kwargs):
        super().__init__(**kwargs)
        self.between = between
        self.gate = keras.layers.Dense(D_FF, activation="gelu", name="gate")
        self.up = keras.layers.Dense(D_FF, name="up")
        self.down = keras.layers.Dense(8, name="down")

    def build(self, shape):
        self.gate.build(shape)
        self.up.build(shape)
        self.down.build((*shape[:-1], D_FF))

    def call(self, x):
        h = self.between(self.gate(x), self.up(x))
        return self.down(h) if h.shape[-1] == D_FF else h


BETWEEN = {
    "elementwise": lambda g, u: tf.sigmoid(g) * u * 0.5 + tf.square(u),
    "a reversal": lambda g, u: tf.reverse(g * u, axis=[1]),
    "a vector": lambda g, u: g * u * tf.range(D_FF, dtype=g.dtype),
    "no row layer": lambda g, u: g[:, :8] * 0.0,
}


@pytest.fixture
def paired_block(monkeypatch):
    monkeypatch.setattr(Block, "call", keras_tp_pairs._dispatcher(
        Block.call, (("gate", "up"), "down", -1), keras_tensor_parallel.pairing_plan))


def _block_model(between):
    x = keras.Input((6,))
    return keras.Model(x, Block(BETWEEN[between], name="block")(x))


def _block_layout_map(shape):
    layout_map = td.LayoutMap(_mesh(shape))
    layout_map["block/(gate|up)/kernel"] = ("batch", "model")
    layout_map["block/(gate|up)/bias"] = ("model",)
    layout_map["block/down/kernel"] = ("model", None)
    return layout_map


@pytest.mark.parametrize("shape", [(1, 2), (2, 2), (1, 4)])
def test_a_paired_block_trains_like_one_device(paired_block, shape):
    strategy = td.ModelParallel(layout_map=_block_layout_map(shape), batch_dim_name="batch")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 6)).astype("float32"), rng.normal(size=(64, 8)).astype("float32")
    with recorded(strategy, "all_to_all") as shapes, recorded(strategy, "all_gather") as gathered:
        report = assert_equivalent(lambda: _block_model("elementwise"), strategy, x, y,
                                   reference=lambda: _block_model("elementwise"),
                                   loss=keras.losses.MeanSquaredError(),
                                   optimizer=lambda: keras.optimizers.Adam(1e-2),
                                   batch_size=16, steps=5, rtol=1e-5)
    print(f"{shape}: {report}")
    # Of the activations, only down's partial sums [M, b, 8] are exchanged (and their
    # gradient); on "batch:2", gate's and up's kernel gradients are reduce-scattered too.
    batch, model = shape
    kernel_gradients = {(batch, 6 // batch, D_FF // model)} if batch > 1 else set()
    assert shapes and {s[-1] for s in shapes if s not in kernel_gradients} == {8}, shapes
    # Gate and up read one gather of the rows [1, b, 6]: one per down's forward exchange.
    rows = [s for s in gathered if s[-1] == 6]
    assert len(rows) == sum(s[-1] == 8 for s in shapes), (gathered, shapes)


@pytest.mark.parametrize("remat", [None, "full"])
def test_a_layer_recomputed_on_its_own_is_not_paired(remat):
    # Its recomputation would run outside the block's pairing. (Training it is refused
    # as long as the LayoutMap splits its weights: the next test.)
    strategy = td.ModelParallel(layout_map=_block_layout_map((1, 2)), batch_dim_name="batch")
    with strategy.scope(), keras.RematScope(mode=remat):
        block = _block_model("elementwise").get_layer("block")

    @tf.function
    def planned():
        return strategy.run(lambda: tf.constant(keras_tensor_parallel.pairing_plan(
            [block.gate, block.up], block.down) is not None))

    assert [bool(v) for v in strategy.experimental_local_results(planned())] == \
        [remat is None] * 2


@pytest.mark.parametrize("shape", [(1, 2), (2, 1)])
def test_recomputing_a_layer_whose_weights_a_layout_map_splits_is_refused(shape):
    strategy = td.ModelParallel(layout_map=_block_layout_map(shape), batch_dim_name="batch")
    with strategy.scope():
        with keras.RematScope(mode="list_of_layers", layer_names=["up"]):
            model = _block_model("elementwise")
        model.compile("sgd", "mse")
    with pytest.raises(NotImplementedError, match="layer 'up' is recomputed .* its weight "
                       "'block/up/kernel' is split by the LayoutMap"):
        model.fit(np.ones((8, 6), "float32"), np.ones((8, 8), "float32"), verbose=0)


@pytest.mark.parametrize("between, message", [
    ("a reversal", "ReverseV2 op"),
    ("a vector", "which is neither paired nor a scalar"),
    ("no row layer", "returned without calling its row layer 'down'"),
])
def test_anything_but_elementwise_ops_between_the_pair_is_an_error(paired_block, between,
                                                                   message):
    strategy = td.ModelParallel(layout_map=_block_layout_map((1, 2)), batch_dim_name="batch")
    with strategy.scope():
        model = _block_model(between)
        model.compile("sgd", "mse")
    with pytest.raises(RuntimeError, match=message):
        model.fit(np.ones((8, 6), "float32"), np.ones((8, 8), "float32"), verbose=0)


def _fit_block(optimizer, x, y, scope=None):
    """The loss curve, weights and optimizer variables of the elementwise block model
    fitted on one device, or under `scope` from the one-device model's initial weights."""
    keras.utils.set_random_seed(0)
    model = reference = _block_model("elementwise")
    if scope is not None:
        with scope():
            model = _block_model("elementwise")
        model.set_weights(reference.get_weights())
    with scope() if scope is not None else contextlib.nullcontext():
        model.compile(optimizer(), keras.losses.MeanSquaredError())
    loss = model.fit(x, y, batch_size=8, shuffle=False, verbose=0).history["loss"]
    return loss, model.get_weights(), [v.numpy() for v in model.optimizer.variables], model


def _rows(n):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 6)).astype("float32"), rng.normal(size=(n, 8)).astype("float32")


def test_keras_training_options_on_a_paired_block_match_one_device(paired_block):
    """global_clipnorm, EMA with overwrite, gradient accumulation and a 4-row last batch
    through the paired block (1x2): the loss curve, weights and every optimizer variable."""
    strategy = td.ModelParallel(layout_map=_block_layout_map((1, 2)), batch_dim_name="batch")
    x, y = _rows(76)

    def optimizer(clipnorm=0.05):
        return lambda: keras.optimizers.Adam(
            1e-2, global_clipnorm=clipnorm, use_ema=True, ema_momentum=0.9,
            ema_overwrite_frequency=3, gradient_accumulation_steps=2)

    with recorded(strategy, "all_to_all") as shapes:
        curve, weights, slots, _ = _fit_block(optimizer(), x, y, strategy.scope)
    reference_curve, reference_weights, reference_slots, _ = _fit_block(optimizer(), x, y)
    assert shapes and {s[-1] for s in shapes} == {8}, shapes  # paired: no d_ff-wide exchange
    np.testing.assert_allclose(curve, reference_curve, rtol=1e-5)
    for a, b in zip(weights + slots, reference_weights + reference_slots):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    _, unclipped, _, _ = _fit_block(optimizer(None), x, y)  # without the threshold: elsewhere
    assert max(np.abs(a - b).max() for a, b in zip(unclipped, reference_weights)) > 1e-3


def test_mixed_bfloat16_on_a_paired_block_matches_the_one_device_model(paired_block,
                                                                        mixed_bfloat16):
    """bfloat16 rounds every partial sum: the weights' relative L2 error, as
    tests/distribution/test_model_parallel.py measures Keras layers."""
    strategy = td.ModelParallel(layout_map=_block_layout_map((1, 2)), batch_dim_name="batch")
    x, y = _rows(80)
    adam = lambda: keras.optimizers.Adam(1e-2)  # noqa: E731
    with recorded(strategy, "all_to_all") as shapes:
        curve, weights, _, model = _fit_block(adam, x, y, strategy.scope)
    reference_curve, reference_weights, _, _ = _fit_block(adam, x, y)
    assert shapes and {s[-1] for s in shapes} == {8}, shapes
    assert model.get_layer("block").down.compute_dtype == "bfloat16"
    a = np.concatenate([w.ravel() for w in weights])
    b = np.concatenate([w.ravel() for w in reference_weights])
    relative = float(np.linalg.norm(a - b) / np.linalg.norm(b))
    loss = max(abs(p - q) / abs(q) for p, q in zip(curve, reference_curve))
    print(f"mixed_bfloat16 paired block 1x2: weights {relative:.1e} (relative L2), loss {loss:.1e}")
    assert relative < 2e-2 and loss < 1e-2
