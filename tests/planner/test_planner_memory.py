"""The planner's bytes per device of weights and optimizer variables equal a real MeshStrategy's."""

import dataclasses

import keras
import pytest

from tfdist.config import TransformerConfig
from tfdist.planner import state_bytes, transformer_inventory
from tfdist.strategies import MeshStrategy
from tfdist.testing.memory import device_bytes

# Every other FFN an MoE; the vocabulary (250) pads on 4 devices, not on 2.
CONFIG = TransformerConfig(vocab_size=250, d_model=32, num_heads=4, d_kv=8, d_ff=64,
                           num_encoder_layers=2, num_decoder_layers=2, max_length=16,
                           moe_experts=4, dropout=0.0)

CASES = [
    ("data:4", "batch:data", CONFIG),
    ("data:2;model:2", "batch:data;heads:model;d_ff:model", CONFIG),
    ("data:2;model:2", "batch:data;experts:model;vocab:model",
     dataclasses.replace(CONFIG, vocab_size=256)),
    # experts and d_ff on one axis: the MoE keeps its hidden units whole
    ("data:1;model:4", "batch:data;heads:model;d_ff:model;experts:model", CONFIG),
    ("data:2;model:4", "batch:data;d_ff:model;vocab:model;experts:model",
     dataclasses.replace(CONFIG, vocab_size=256, share_embeddings=False)),
    # a split sequence: the learned positions and every weight as the rest of the mesh lays it
    ("data:1;seq:2;model:2", "batch:data;length:seq;heads:model;d_ff:model",
     dataclasses.replace(CONFIG, moe_experts=0, positions="learned")),
]


@pytest.mark.parametrize("mesh_shape,layout,config", CASES)
def test_weights_and_optimizer_bytes_equal_the_strategys(mesh_shape, layout, config):
    from tfdist.models import Transformer

    strategy = MeshStrategy(mesh_shape, layout)
    predicted = state_bytes(transformer_inventory(config, strategy.mesh, "adam"), strategy.mesh)
    with strategy.scope():
        model = Transformer(config, name="transformer")
        model.build()
        model.compile(keras.optimizers.Adam(), "mse")
        model.optimizer.build(model.trainable_variables)
    measured = {device_bytes(model, i) for i in range(strategy.mesh.size)}
    weights, optimizer, _ = predicted
    assert measured == {weights + optimizer}, (mesh_shape, layout)
    plain = sum(v.numpy().nbytes for v in model.weights)
    if strategy.mesh.size > 1 and "model" in mesh_shape:
        assert weights < plain  # the layout splits something: the check is not vacuous
