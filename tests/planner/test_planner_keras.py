"""Layout maps derived for any Keras model: keras-hub's hand-written ones where they exist,
exact memory and one device's training where none does."""

import keras
import keras_hub
import numpy as np
import pytest

import tfdist.distribution as td
from tfdist.planner import Calibration, Inventory, plan_keras, state_bytes
from tfdist.planner.derive import layout_map, logical_axes
from tfdist.mesh import Mesh
from tfdist.testing.equivalence import assert_equivalent
from tfdist.testing.memory import device_bytes

VOCAB, LENGTH = 64, 8
ATTENTION = dict(num_query_heads=4, num_key_value_heads=2, hidden_dim=16)
RULES = "heads:model;d_ff:model;vocab:model;d_model:batch"  # keras-hub's: FSDP on the hidden dim


def keras_mesh(shape, names=("batch", "model")):
    n = int(np.prod(shape))
    return keras.distribution.DeviceMesh(shape, names, [f"cpu:{i}" for i in range(n)])


def layouts(layout_map_, model):
    """{path: mesh axes or None} a LayoutMap gives each weight."""
    out = {}
    for v in model.weights:
        layout = layout_map_[v.path]
        out[v.path] = None if layout is None else tuple(layout.axes)
    return out


def test_gemmas_derived_layout_map_is_its_hand_written_one():
    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=VOCAB, num_layers=2,
                                              intermediate_dim=64, head_dim=4, **ATTENTION)
    mesh = keras_mesh((2, 2))
    derived = layouts(layout_map(backbone, mesh, RULES), backbone)
    assert derived == layouts(backbone.get_layout_map(mesh, data_parallel_dim_name="batch"),
                              backbone)
    assert derived["decoder_block_1/ffw_linear/kernel"] == ("model", "batch")


def test_llamas_derived_map_differs_from_its_hand_written_one_only_where_that_splits_hidden():
    backbone = keras_hub.models.LlamaBackbone(vocabulary_size=VOCAB, num_layers=2,
                                              intermediate_dim=32, **ATTENTION)
    mesh = keras_mesh((2, 2))
    derived = layouts(layout_map(backbone, mesh, RULES), backbone)
    hand = layouts(backbone.get_layout_map(mesh, data_parallel_dim_name="batch"), backbone)
    differ = sorted(p for p in derived if derived[p] != hand[p])
    # keras-hub's Llama map copies Gemma's (heads, hidden, head_dim) tuple onto Llama's
    # (hidden, heads, head_dim) query/key/value kernels: the hidden dimension on the model
    # axis (row-parallel, a reduce-scatter per projection); and leaves the untied output
    # table whole. Derived: heads on the model axis (Megatron), the table split by vocabulary.
    assert differ == ["token_embedding/reverse_embeddings"] + [
        f"transformer_layer_{i}/self_attention/{k}/kernel" for i in (0, 1)
        for k in ("key", "query", "value")]
    assert derived["transformer_layer_0/self_attention/query/kernel"] == ("batch", "model", None)
    assert hand["transformer_layer_0/self_attention/query/kernel"] == ("model", "batch", None)


def language_model(cls, config):
    backbone = cls(vocabulary_size=VOCAB, num_layers=1, name="backbone", **config)
    inputs = {"token_ids": keras.Input((LENGTH,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((LENGTH,), dtype="int32", name="padding_mask")}
    logits = backbone.token_embedding(backbone(inputs), reverse=True)
    return keras.Model(inputs, logits)


# Adam turns float reordering on small gradients into weight noise: TF's own
# MirroredStrategy on the same 4 devices leaves Qwen3's weights 2.0e-5 from one
# device after these 10 steps (gradients 5.2e-7), as Llama's (tests/distribution).
RTOL = {"mistral": 1e-5, "qwen3": 3e-5, "gemma3": 1e-5, "phi3": 1e-5}

# Backbones keras-hub has no layout map for.
NO_MAP = {
    "mistral": (keras_hub.models.MistralBackbone, dict(intermediate_dim=32, **ATTENTION)),
    "qwen3": (keras_hub.models.Qwen3Backbone, dict(intermediate_dim=32, head_dim=4,
                                                   **ATTENTION)),
    "gemma3": (keras_hub.models.Gemma3Backbone, dict(image_size=None, intermediate_dim=32,
                                                     head_dim=4, **ATTENTION)),
    "phi3": (keras_hub.models.Phi3Backbone, dict(intermediate_dim=32, **ATTENTION)),
}


@pytest.mark.parametrize("name", sorted(NO_MAP))
def test_a_backbone_without_a_map_trains_on_the_planned_one_like_one_device(name):
    cls, config = NO_MAP[name]
    assert "get_layout_map" not in cls.__dict__
    build = lambda: language_model(cls, config)  # noqa: E731
    model = build()
    cal = Calibration({4: 1e10}, {(k, n): (1e-4, 1e-9) for n in (2, 4) for k in (
        "all_reduce", "all_gather", "reduce_scatter", "all_to_all")}, {4: 1e-3}, {4: 1e-9})
    plan = plan_keras(model, 4, global_batch=16, length=LENGTH, calibration=cal)
    # the 2 x 2 layout splitting heads, d_ff and the vocabulary, weights FSDP over the batch
    candidate = next(c for c in plan.ranked if str(c.mesh.shape) == "data:2;model:2" and
                     str(c.mesh.rules) == "batch:data;heads:model;d_ff:model;vocab:model;"
                                          "d_model:data")
    mesh = keras_mesh((2, 2), ("data", "model"))
    strategy = td.ModelParallel(layout_map=layout_map(model, mesh, candidate.mesh.rules),
                                batch_dim_name="data")
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, VOCAB, (160, LENGTH)).astype("int32"),
         "padding_mask": np.ones((160, LENGTH), "int32")}
    y = rng.integers(0, VOCAB, (160, LENGTH)).astype("int32")
    report = assert_equivalent(build, strategy, x, y, rtol=RTOL[name],
                               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                               optimizer=lambda: keras.optimizers.Adam(1e-3), batch_size=16,
                               steps=10, reference=build)  # the same model on one device
    print(f"{name} on the planned map {candidate.mesh}: {report}")
    weights, optimizer, _ = state_bytes(
        Inventory.of(report.model, "adam", axes=logical_axes(report.model)), candidate.mesh)
    measured = {device_bytes(report.model, i) for i in range(4)}
    assert measured == {weights + optimizer}
    whole = sum(v.numpy().nbytes for v in report.model.weights + report.model.optimizer.variables)
    assert weights + optimizer < whole / 3  # split, not a replica in disguise
