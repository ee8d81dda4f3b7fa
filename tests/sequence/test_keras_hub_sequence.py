"""keras-hub's Llama under `ModelParallel(..., sequence_axis=...)` trains like one device.

Every sequence is split over the mesh axis (zig-zag, `split_sequences`): the
embedding, norms and feed-forward run on each device's tokens,
`LlamaAttention` attends over the whole causal sequence (ring or Ulysses) with
rotary positions at the tokens' global positions and the keys' padding. The
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


def language_model(cls=keras_hub.models.LlamaBackbone, **extra):
    """A one-layer Llama with grouped queries, logits from its reversible embedding."""
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
def reference(data):
    return run_reference(language_model, *data, reference=language_model, **TRAINING)


@pytest.mark.parametrize("shape, axes, method, layout_map", [
    ((1, 2), ("batch", "seq"), "ring", False),
    ((2, 2), ("batch", "seq"), "ulysses", False),
    # With Llama's own layout map: heads and the feed-forward split over `model` too.
    ((1, 2, 2), ("batch", "model", "seq"), "ring", True),
])
def test_llama_over_a_split_sequence_trains_like_one_device(data, reference, monkeypatch,
                                                             shape, axes, method, layout_map):
    from tfdist import sequence

    n = int(np.prod(shape))
    mesh = td.DeviceMesh(shape, axes, [f"cpu:{i}" for i in range(n)])
    strategy = td.ModelParallel(
        device_mesh=mesh, batch_dim_name="batch", sequence_axis="seq", sequence_method=method,
        layout_map=keras_hub.models.LlamaBackbone.get_layout_map(mesh) if layout_map else None)
    calls = []
    attend = sequence.METHODS[method]

    def spy(q, k, v, axis, **kwargs):  # the attention runs over the axis, on 4 of 8 tokens
        calls.append((axis, int(q.shape[1]), kwargs["causal"]))
        return attend(q, k, v, axis, **kwargs)

    monkeypatch.setitem(sequence.METHODS, method, spy)
    report = assert_equivalent(language_model, strategy, *data, reference=language_model,
                               reference_run=reference, rtol=1e-5, **TRAINING)
    assert calls and set(calls) == {("seq", LENGTH // 2, True)}, calls
    print(f"llama {shape} {axes} {method}: {report}")


def test_attention_tfdist_cannot_split_is_refused_when_built():
    mesh = td.DeviceMesh((1, 2), ("batch", "seq"), ["cpu:0", "cpu:1"])
    strategy = td.ModelParallel(device_mesh=mesh, batch_dim_name="batch", sequence_axis="seq")
    with strategy.scope():
        with pytest.raises(ValueError, match=r"\(CachedGemmaAttention\) attends over the whole "
                                             r"sequence, which mesh axis 'seq' splits"):
            language_model(keras_hub.models.GemmaBackbone, head_dim=4)

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
