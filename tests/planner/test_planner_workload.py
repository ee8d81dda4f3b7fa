"""The planner's collectives are the ones tfdist's Transformer sends (traced, per device)."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from tfdist.config import TransformerConfig
from tfdist.planner import transformer_work
from tfdist.strategies import MeshStrategy
from tfdist.testing.collective_log import recorded

CONFIG = TransformerConfig(vocab_size=64, d_model=16, num_heads=4, d_kv=4, d_ff=32,
                           num_encoder_layers=2, num_decoder_layers=1, max_length=8,
                           dropout=0.0)
BATCH, LENGTH = 8, 8


def _traced_bytes(strategy, config):
    """{backend primitive: bytes one device passes it} for a forward and backward step."""
    from tfdist.models import SequenceCrossentropy, Transformer

    with strategy.scope():
        model = Transformer(config, name="transformer")
        model.build()
    loss_fn = SequenceCrossentropy(config.vocab_size)
    mesh = strategy.mesh
    parts = mesh.axis_size(mesh.mesh_axis("length"))  # a device's tokens of P-fold rows
    rows = BATCH // mesh.size * parts
    ids = tf.constant(np.random.default_rng(0).integers(3, config.vocab_size,
                                                        (rows, LENGTH // parts)), tf.int32)

    def replica_step(source, target):
        with tf.GradientTape() as tape:
            loss = loss_fn(target, model((source, target), training=True))
        return tape.gradient(loss, model.trainable_variables)

    got = {}
    with recorded(strategy, "all_gather") as gathers, \
            recorded(strategy, "all_to_all") as exchanges, \
            recorded(strategy, "all_reduce") as sums, \
            recorded(strategy, "permute") as swaps:
        tf.function(lambda: strategy.run(replica_step, args=(ids, ids))).get_concrete_function()
    for name, shapes in (("all_gather", gathers), ("all_to_all", exchanges), ("all_reduce", sums),
                         ("permute", swaps)):
        got[name] = sum(int(np.prod(s)) for s in shapes) * 4 // strategy.mesh.size
    got["all_gather"] -= got["permute"]  # TF's backend swaps a pair by a two-device gather
    return got


def _predicted_bytes(config, strategy):
    work = transformer_work(config, strategy.mesh, BATCH, LENGTH)  # no gradient sums
    want = {"all_gather": 0, "all_to_all": 0, "all_reduce": 0, "permute": 0}
    primitive = {"all_gather": "all_gather", "all_reduce": "all_reduce",
                 "reduce_scatter": "all_to_all", "all_to_all": "all_to_all",  # parts exchanged
                 "send": "permute"}  # a ring's pair swap
    for c in work.collectives:
        want[primitive[c.kind]] += c.count * c.bytes
    return want


@pytest.mark.parametrize("mesh_shape,layout,config", [
    ("data:2;model:2", "batch:data;heads:model;d_ff:model", CONFIG),
    ("data:1;model:4", "batch:data;d_ff:model;vocab:model", CONFIG),
    ("data:2;model:2", "batch:data;experts:model",
     dataclasses.replace(CONFIG, moe_experts=4, moe_group_size=16)),
    # a split sequence: ring swaps (with heads also split), Ulysses all-to-alls
    ("data:1;seq:2;model:2", "batch:data;length:seq;heads:model;d_ff:model", CONFIG),
    ("data:1;seq:4;model:1", "batch:data;length:seq", CONFIG),
    ("data:2;seq:2;model:1", "batch:data;length:seq",
     dataclasses.replace(CONFIG, sequence_method="ulysses")),
    # an MoE over a split sequence (groups of 2 inside the zig-zag chunks of 2): its
    # all-to-all over each device's own tokens, beside the ring's swaps
    ("data:1;seq:2;model:2", "batch:data;length:seq;experts:model",
     dataclasses.replace(CONFIG, moe_experts=4, moe_group_size=2)),
    # Megatron sequence parallelism: tokens gathered over the heads' axis, no ring
    ("data:1;model:2", "batch:data;length:model;heads:model;d_ff:model", CONFIG),
])
def test_predicted_exchanges_equal_the_traced_ones(mesh_shape, layout, config):
    strategy = MeshStrategy(mesh_shape, layout)
    got = _traced_bytes(strategy, config)
    want = _predicted_bytes(config, strategy)
    assert got["all_to_all"] + got["permute"] > 0 or "length:model" in layout
    assert got["all_gather"] == want["all_gather"], (want, got)
    assert got["all_to_all"] == want["all_to_all"], (want, got)
    assert got["permute"] == want["permute"], (want, got)
    # the loss's token count adds a scalar or two
    assert want["all_reduce"] <= got["all_reduce"] <= want["all_reduce"] + 8, (want, got)
