"""Recurrent layers and loops under ModelParallel: split weights read once, before the loop.

A Keras `LSTM`, `GRU` or `SimpleRNN` (or a cell under `keras.layers.RNN`, or a
layer running its own `keras.ops.while_loop`) reads its weights inside a
`tf.while_loop`. Split by a `LayoutMap`, each is read gathered, once, before
the loop (`tfdist.internal.keras_loop_reads`); the sharded model trains as one
device does. The reference is the same plain Keras model on one device.
"""

import re

import keras
import numpy as np
import pytest

import tfdist.distribution as td
from tfdist.layers import ShardedDense
from tfdist.strategies import MeshStrategy
from tfdist.testing.collective_log import recorded
from tfdist.testing.equivalence import assert_equivalent, run_reference

VOCAB, LENGTH, D, UNITS, CLASSES = 16, 5, 8, 16, 4


@keras.saving.register_keras_serializable(package="tfdist_tests")
class LoopRecurrence(keras.layers.Layer):
    """A layer tfdist has never seen: `h_t = tanh(x_t W + h_{t-1} U)` in its own while_loop.

    Input `[batch, length, d]`, output `[batch, units]` (the last `h`).
    """

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(name="w", shape=(input_shape[-1], self.units))
        self.u = self.add_weight(name="u", shape=(self.units, self.units))

    def call(self, x):
        steps = x.shape[1]

        def body(t, h):
            x_t = keras.ops.take(x, t, axis=1)  # [batch, d]
            return t + 1, keras.ops.tanh(keras.ops.matmul(x_t, self.w) +
                                         keras.ops.matmul(h, self.u))

        h = keras.ops.zeros_like(x[:, 0, :1]) * keras.ops.zeros((1, self.units))  # [batch, units]
        _, h = keras.ops.while_loop(lambda t, h: t < steps, body, (0, h))
        return h

    def get_config(self):
        return {**super().get_config(), "units": self.units}


@keras.saving.register_keras_serializable(package="tfdist_tests")
class MinimalCell(keras.layers.Layer):
    """A custom RNN cell: `h_t = tanh(Dense(x_t) + h_{t-1} R)`.

    Its `Dense` runs inside the loop: there it reads its kernel whole (gathered
    before the loop) rather than computing on its shard as it would outside.
    """

    def __init__(self, units, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.state_size = units
        self.project = keras.layers.Dense(units, use_bias=False, name="project")

    def build(self, input_shape):
        self.project.build(input_shape)
        self.recurrent_kernel = self.add_weight(name="recurrent_kernel",
                                                shape=(self.units, self.units))

    def call(self, inputs, states):
        h = keras.ops.tanh(self.project(inputs) +
                           keras.ops.matmul(states[0], self.recurrent_kernel))
        return h, [h]

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def recurrent(kind, **options):
    if kind == "loop":
        return LoopRecurrence(UNITS, name="rnn")
    if kind == "cell":
        return keras.layers.RNN(MinimalCell(UNITS), name="rnn", **options)
    return getattr(keras.layers, kind)(UNITS, name="rnn", **options)


def model_of(kind, **options):
    """ids [batch, length] -> Embedding -> recurrent layer -> Dense logits [batch, classes]."""

    def build():
        ids = keras.Input((LENGTH,), dtype="int32")
        x = keras.layers.Embedding(VOCAB, D, name="token")(ids)
        x = recurrent(kind, **options)(x)
        return keras.Model(ids, keras.layers.Dense(CLASSES, name="head")(x))

    return build


def keras_mesh(shape):
    n = int(np.prod(shape))
    return td.DeviceMesh(shape, ("batch", "model"), [f"cpu:{i}" for i in range(n)])


RECURRENT = "rnn/(.*kernel|w|u)"  # paths of the recurrent layer's matrices


def strategy_for(shape, layout, key=RECURRENT):
    """`key` (default: the recurrent layer's kernels, recurrent kernels, or `w` and `u`)
    laid out `layout`, the head's kernel row-parallel."""
    layout_map = td.LayoutMap(keras_mesh(shape))
    layout_map[key] = layout
    layout_map["head/kernel"] = ("model", None)  # row-parallel after the loop
    return td.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, VOCAB, (n, LENGTH)).astype("int32"),
            rng.integers(0, CLASSES, (n,)).astype("int32"))


def check(build, strategy, rtol=1e-5):
    """Forward, loss, gradients, weights and Adam's slots after 6 steps of `fit` against
    the same plain Keras model on one device (max relative difference per tensor), and
    the trained weights' relative L2 error; all within `rtol`."""
    x, y = data()
    args = dict(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                optimizer=lambda: keras.optimizers.Adam(1e-2), batch_size=8, steps=6,
                reference=build)
    reference = run_reference(build, x, y, **args)
    report = assert_equivalent(build, strategy, x, y, reference_run=reference, rtol=rtol,
                               **args)
    recurrent_weights = [v for v in report.model.weights if re.fullmatch(RECURRENT, v.path)]
    assert len(recurrent_weights) >= 2 and all(
        v.value.layout.is_sharded for v in recurrent_weights), "the weights are not split"
    l2 = relative_l2(report.model.get_weights(), reference.weights)
    assert l2 <= rtol, f"weights {l2:.1e} (relative L2) from one device's"
    return f"{report}; weights {l2:.1e} relative L2"


def relative_l2(weights, expected) -> float:
    """`||w - w_ref|| / ||w_ref||` over all weights, concatenated."""
    a = np.concatenate([w.ravel() for w in weights])
    b = np.concatenate([w.ravel() for w in expected])
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# One mesh and layout per recurrent layer: FSDP over the model axis, the batch axis or
# both (the LSTM on two meshes), and ZeRO-2 (a kept whole copy, gradients
# reduce-scattered) for the SimpleRNN.
@pytest.mark.parametrize("kind, strategy", [
    ("LSTM", lambda: strategy_for((1, 2), ("model", None))),
    ("LSTM", lambda: strategy_for((2, 2), ("batch", "model"))),
    ("GRU", lambda: strategy_for((2, 2), (None, "model"))),
    ("SimpleRNN", lambda: td.DataParallel(devices=["cpu:0", "cpu:1"], zero_stage=2)),
    ("loop", lambda: strategy_for((2, 2), ("model", "batch"))),
    ("cell", lambda: strategy_for((1, 2), (None, "model"))),
], ids=["LSTM-1x2-model", "LSTM-2x2-batch,model", "GRU-2x2-None,model", "SimpleRNN-zero2",
        "loop-2x2-model,batch", "cell-1x2-None,model"])
def test_a_recurrent_layer_with_split_weights_matches_one_device(kind, strategy):
    print(kind, check(model_of(kind), strategy()))


def test_an_unrolled_lstm_matches_one_device():
    report = check(model_of("LSTM", unroll=True), strategy_for((1, 2), (None, "model")))
    print("unrolled LSTM", report)


def test_steps_per_execution_reads_every_step_s_weights():
    """Keras runs `steps_per_execution` steps in one while_loop, each step a function of its
    own: every step reads the weights the step before it updated."""
    build, x, y = model_of("GRU"), *data()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = run_reference(build, x, y, loss=loss, reference=build, batch_size=8, steps=6,
                              optimizer=lambda: keras.optimizers.Adam(1e-2))
    strategy = strategy_for((1, 2), ("model", None))
    with strategy.scope():
        model = build()
        model.compile(keras.optimizers.Adam(1e-2), loss, steps_per_execution=3)
    model.set_weights(reference.initial_weights)
    model.fit(x[:48], y[:48], batch_size=8, shuffle=False, verbose=0)
    l2 = relative_l2(model.get_weights(), reference.weights)
    print(f"GRU, steps_per_execution=3: weights {l2:.1e} relative L2")
    assert l2 <= 1e-5


def _exchanged_shapes(build, strategy):
    """Shapes of every all-gather and all-to-all traced by one training step."""
    with strategy.scope():
        model = build()
        model.compile(keras.optimizers.SGD(0.1),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(8)
    with recorded(strategy, "all_gather") as gathers, recorded(strategy, "all_to_all") as sent:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    return gathers, sent


@pytest.mark.parametrize("unroll", [False, True])
def test_each_split_lstm_weight_is_gathered_and_reduce_scattered_once_per_step(unroll):
    gathers, sent = _exchanged_shapes(model_of("LSTM", unroll=unroll),
                                      strategy_for((1, 2), ("model",), key="rnn/.*"))
    # Shards on the model axis: kernel [D/2, 4U], recurrent kernel [U/2, 4U], bias [2U].
    shards = [(D // 2, 4 * UNITS), (UNITS // 2, 4 * UNITS), (2 * UNITS,)]
    # Gathered as shard[tf.newaxis]; the gradient reduce-scattered as an all-to-all of
    # its two halves [2, *shard]: once per replica (two), not once per time step (five).
    assert sorted(s for s in gathers if s[1:] in shards) == sorted([(1, *s) for s in shards] * 2)
    assert sorted(s for s in sent if s[1:] in shards) == sorted([(2, *s) for s in shards] * 2)


def test_a_tfdist_layer_computing_on_shards_inside_a_loop_is_refused_by_name():
    class ShardedCell(MinimalCell):
        def __init__(self, units, **kwargs):
            super().__init__(units, **kwargs)
            self.project = ShardedDense(units, kernel_axes=("d_model", "d_ff"),
                                        use_bias=False, name="sharded_in_cell")

    strategy = MeshStrategy("data:1;model:2", "d_ff:model")
    with strategy.scope():
        inputs = keras.Input((LENGTH, D))
        model = keras.Model(inputs, keras.layers.RNN(ShardedCell(UNITS), name="rnn")(inputs))
        model.compile(keras.optimizers.SGD(0.1), "mse")
    x = np.zeros((4, LENGTH, D), "float32")
    with pytest.raises(ValueError, match=r"ShardedDense 'sharded_in_cell' runs a collective "
                                         r"\(all_gather\) inside a while_loop within the call "
                                         r"of RNN 'rnn'"):
        model.fit(x, np.zeros((4, UNITS), "float32"), batch_size=4, epochs=1, verbose=0)
