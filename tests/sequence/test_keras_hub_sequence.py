"""keras-hub's Llama, Gemma and Qwen under `ModelParallel(..., sequence_axis=...)` train like one
device.

Every sequence is split over the mesh axis (zig-zag, `split_sequences`): the
embedding, norms and feed-forward run on each device's tokens,
`LlamaAttention` attends over the whole causal sequence (ring or Ulysses) with
rotary positions at the tokens' global positions and the keys' padding (Gemma's
attention too, with its query scaling and wiping). The
reference is the same unmodified model on one device (keras-hub's own dense
attention over whole sequences): loss, gradients and weights after 10 Adam
steps must agree.
"""

import keras
import keras_hub
import numpy as np
import pytest

import tfdist.distribution as td
from tfdist.testing.equivalence import assert_equivalent, run_reference

VOCAB, LENGTH, ROWS = 64, 8, 40


BACKBONES = {"llama": (keras_hub.models.LlamaBackbone, {}),
             "gemma": (keras_hub.models.GemmaBackbone, {"head_dim": 4}),
             "qwen": (keras_hub.models.QwenBackbone, {}),
             "qwen_window": (keras_hub.models.QwenBackbone,
                             {"use_sliding_window_attention": True, "sliding_window_size": 4})}


def language_model(cls=keras_hub.models.LlamaBackbone, **extra):
    """A one-layer backbone with grouped queries, logits from its reversible embedding."""
    backbone = cls(vocabulary_size=VOCAB, num_layers=1, num_query_heads=4,
                   num_key_value_heads=2, hidden_dim=16, intermediate_dim=32, name="backbone",
                   **extra)
    inputs = {"token_ids": keras.Input((None,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((None,), dtype="int32", name="padding_mask")}
    return keras.Model(inputs, backbone.token_embedding(backbone(inputs), reverse=True))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    mask = np.ones((ROWS, LENGTH), "int32")
    mask[::3, -3:] = 0  # right padding, as keras-hub's preprocessors pad
    x = {"token_ids": rng.integers(0, VOCAB, (ROWS, LENGTH)).astype("int32"),
         "padding_mask": mask}
    return x, rng.integers(0, VOCAB, (ROWS, LENGTH)).astype("int32")


TRAINING = dict(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                optimizer=lambda: keras.optimizers.Adam(1e-3), batch_size=4, steps=10)


@pytest.fixture(scope="module")
def references(data):
    """One device's run per backbone, computed once."""
    runs = {}

    def reference(name):
        if name not in runs:
            build = _builder(name)
            runs[name] = run_reference(build, *data, reference=build, **TRAINING)
        return runs[name]

    return reference


def _builder(name):
    cls, extra = BACKBONES[name]
    return lambda: language_model(cls, **extra)


@pytest.mark.parametrize("name, shape, axes, method, layout_map", [
    ("llama", (1, 2), ("batch", "seq"), "ring", False),
    ("llama", (2, 2), ("batch", "seq"), "ulysses", False),
    # With the backbone's own layout map: heads and the feed-forward split over `model` too.
    ("llama", (1, 2, 2), ("batch", "model", "seq"), "ring", True),
    ("gemma", (1, 2), ("batch", "seq"), "ring", False),
    ("gemma", (1, 2, 2), ("batch", "model", "seq"), "ulysses", True),
    ("qwen", (1, 2), ("batch", "seq"), "ring", False),  # Llama's attention, with biases
    # A sliding window of 4 over 8 tokens (zig-zag chunks of 2: the last chunk skips the
    # first; every query still sees a valid key past the 3 padded ones).
    ("qwen_window", (1, 2), ("batch", "seq"), "ulysses", False),
])
def test_a_backbone_over_a_split_sequence_trains_like_one_device(
        data, references, monkeypatch, name, shape, axes, method, layout_map):
    from tfdist import sequence

    n = int(np.prod(shape))
    mesh = td.DeviceMesh(shape, axes, [f"cpu:{i}" for i in range(n)])
    strategy = td.ModelParallel(
        device_mesh=mesh, batch_dim_name="batch", sequence_axis="seq", sequence_method=method,
        layout_map=BACKBONES[name][0].get_layout_map(mesh) if layout_map else None)
    calls = []
    attend = sequence.METHODS[method]

    def spy(q, k, v, axis, **kwargs):  # the attention runs over the axis, on 4 of 8 tokens
        calls.append((axis, int(q.shape[1]), kwargs["causal"]))
        return attend(q, k, v, axis, **kwargs)

    monkeypatch.setitem(sequence.METHODS, method, spy)
    build = _builder(name)
    report = assert_equivalent(build, strategy, *data, reference=build,
                               reference_run=references(name), rtol=1e-5, **TRAINING)
    assert calls and set(calls) == {("seq", LENGTH // 2, True)}, calls
    print(f"{name} {shape} {axes} {method}: {report}")


def test_attention_tfdist_cannot_split_is_refused_when_built():
    mesh = td.DeviceMesh((1, 2), ("batch", "seq"), ["cpu:0", "cpu:1"])
    strategy = td.ModelParallel(device_mesh=mesh, batch_dim_name="batch", sequence_axis="seq")
    with strategy.scope():
        with pytest.raises(ValueError, match=r"\(MultiHeadAttention\) attends over the whole "
                                             r"sequence, which mesh axis 'seq' splits"):
            keras.layers.MultiHeadAttention(2, 4)(keras.ops.ones((1, 4, 8)),
                                                  keras.ops.ones((1, 4, 8)))

    class WindowAttention(keras.layers.Layer):  # a user's own: tfdist cannot know its mixing
        def build(self, shape):
            self.kernel = self.add_weight(shape=(shape[-1], shape[-1]))

        def call(self, x):
            return x @ self.kernel

    with strategy.scope():
        with pytest.raises(ValueError, match=r"\(WindowAttention\) attends over the whole"):
            WindowAttention()(keras.ops.ones((1, 4, 2)))


@pytest.mark.parametrize("kwargs, match", [
    (dict(sequence_axis="batch"), "sequence_axis='batch' must be an axis of the DeviceMesh "
                                  "other than the batch axis 'batch'"),
    (dict(sequence_axis="length"), r"the mesh's axes are \['batch', 'seq'\]"),
    (dict(sequence_axis="seq", sequence_method="flash"),
     r"sequence_method='flash' is not one of \['ring', 'ulysses'\]"),
])
def test_bad_sequence_arguments_name_the_value(kwargs, match):
    mesh = td.DeviceMesh((1, 2), ("batch", "seq"), ["cpu:0", "cpu:1"])
    with pytest.raises(ValueError, match=match):
        td.ModelParallel(device_mesh=mesh, batch_dim_name="batch", **kwargs)


@pytest.mark.parametrize("cls, options, what", [
    (keras_hub.models.GemmaBackbone, dict(head_dim=4, attention_logit_soft_cap=50.0),
     r"attention logits soft-capped \(Gemma 2\)"),
])
def test_options_the_split_cannot_compute_are_refused(data, cls, options, what):
    mesh = td.DeviceMesh((1, 2), ("batch", "seq"), ["cpu:0", "cpu:1"])
    strategy = td.ModelParallel(device_mesh=mesh, batch_dim_name="batch", sequence_axis="seq")
    with strategy.scope():
        model = language_model(cls, **options)
        model.compile(optimizer="adam",
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    from tfdist.sequence import split_sequences
    import tensorflow as tf

    dataset = split_sequences(tf.data.Dataset.from_tensor_slices(data).batch(4).take(1),
                              strategy.mesh)
    with pytest.raises(ValueError, match=r"over a sequence split on mesh axis 'seq': " + what
                       + " is not supported"):
        model.fit(dataset, verbose=0)
