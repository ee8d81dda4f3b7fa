"""keras-hub backbones, unmodified, with their own get_layout_map: equal to one device."""

import keras
import keras_hub
import numpy as np
import pytest

import tfdist.distribution as td
from tfdist.testing.equivalence import assert_equivalent, run_reference
from tfdist.testing.memory import device_bytes

VOCAB, LENGTH = 64, 8

BACKBONES = {
    "gemma": (keras_hub.models.GemmaBackbone, dict(
        num_query_heads=4, num_key_value_heads=2, hidden_dim=16, intermediate_dim=64,
        head_dim=4)),
    "llama": (keras_hub.models.LlamaBackbone, dict(
        num_query_heads=4, num_key_value_heads=2, hidden_dim=16, intermediate_dim=32)),
    # Its load-balancing loss is on (and exact: tfdist.internal.keras_hub_moe_loss).
    "qwen_moe": (keras_hub.models.QwenMoeBackbone, dict(
        num_query_heads=4, num_key_value_heads=2, hidden_dim=16, intermediate_dim=32,
        moe_intermediate_dim=16, shared_expert_intermediate_dim=32, num_experts=4, top_k=2)),
}

# Adam turns float reordering on small gradients into weight noise: TF's own
# MirroredStrategy on the same 4 devices leaves Llama's weights 1.8e-5 from one
# device after these 10 steps (tfdist: 1.0e-5).
RTOL = {"gemma": 1e-5, "llama": 2e-5, "qwen_moe": 1e-5}


def language_model(name):
    """The backbone with logits from its (reversible) token embedding."""
    cls, config = BACKBONES[name]
    backbone = cls(vocabulary_size=VOCAB, num_layers=1, name="backbone", **config)
    inputs = {"token_ids": keras.Input((LENGTH,), dtype="int32", name="token_ids"),
              "padding_mask": keras.Input((LENGTH,), dtype="int32", name="padding_mask")}
    logits = backbone.token_embedding(backbone(inputs), reverse=True)
    return keras.Model(inputs, logits)


# Each backbone on 1x2 (tensor parallel), 2x1 (FSDP) and 2x2 (both), against one
# reference run.
@pytest.mark.parametrize("name", sorted(BACKBONES))
def test_a_keras_hub_backbone_with_its_layout_map_matches_one_device(name):
    rng = np.random.default_rng(0)
    mask = np.ones((160, LENGTH), "int32")
    mask[::3, -2:] = 0  # some padding
    x = {"token_ids": rng.integers(0, VOCAB, (160, LENGTH)).astype("int32"),
         "padding_mask": mask}
    y = rng.integers(0, VOCAB, (160, LENGTH)).astype("int32")
    training = dict(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    optimizer=lambda: keras.optimizers.Adam(1e-3), batch_size=16, steps=10,
                    reference=lambda: language_model(name))
    reference = run_reference(lambda: language_model(name), x, y, **training)
    for shape in [(1, 2), (2, 1), (2, 2)]:
        n = int(np.prod(shape))
        mesh = td.DeviceMesh(shape, ("batch", "model"), [f"cpu:{i}" for i in range(n)])
        strategy = td.ModelParallel(layout_map=BACKBONES[name][0].get_layout_map(mesh),
                                    batch_dim_name="batch")
        report = assert_equivalent(lambda: language_model(name), strategy, x, y,
                                   reference_run=reference, rtol=RTOL[name], **training)
        variables = report.model.weights + report.model.optimizer.variables
        one_device = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)
        per_device = [device_bytes(report.model, i) for i in range(n)]
        print(f"{name} {shape}: {report}; weights+slots per device {per_device} bytes, "
              f"one device {one_device} ({max(per_device) / one_device:.2f})")
        assert max(per_device) < one_device  # the big weights are split
