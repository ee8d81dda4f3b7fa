"""The planner's pipeline candidates: bytes per device of weights, Adam's variables and
gradients equal a real pipelined Transformer's, stage by stage; the states sent between
stages are the ones the stages return; the ranking weighs pipelines with the rest."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.config import TransformerConfig
from tfdist.mesh import Mesh
from tfdist.pipeline.layout import PipelinePlan
from tfdist.planner import Calibration, plan as plan_layouts, transformer_inventory
from tfdist.planner.pipeline import (_state_after, pipeline_memory_and_work, pipeline_plans,
                                     stage_state_bytes)

# 3 + 3 blocks (a stage boundary inside the encoder on 4 stages... and 6 = 2 x 3), MoE
# every other FFN, learned positions, untied embeddings.
CONFIG = TransformerConfig(vocab_size=96, d_model=16, num_heads=2, d_kv=8, d_ff=32,
                           num_encoder_layers=3, num_decoder_layers=3, max_length=8,
                           moe_experts=2, moe_group_size=8, positions="learned",
                           share_embeddings=False, dropout=0.0)
CASES = [("stage:2;data:1", CONFIG), ("stage:3;data:1", CONFIG),
         ("stage:2;data:2", dataclasses.replace(CONFIG, share_embeddings=True,
                                                positions="sinusoidal", moe_experts=0))]
CPUS = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(8)]


def _device_bytes(model):
    """{device index: bytes} of the model's weights and its optimizer's variables."""
    out, seen = {}, set()
    for v in list(model.weights) + list(model.optimizer.variables):
        if id(v) in seen:  # a tied table is listed by every stage using it
            continue
        seen.add(id(v))
        index = tf.DeviceSpec.from_string(v.value.device).device_index
        out[index] = out.get(index, 0) + v.numpy().nbytes
    return out


@pytest.mark.parametrize("mesh_shape,config", CASES)
def test_stage_bytes_equal_a_pipelined_transformers(mesh_shape, config):
    from tfdist.models.transformer_pipeline import pipelined_transformer

    stack = config.num_encoder_layers + config.num_decoder_layers
    plan = PipelinePlan.from_mesh(mesh_shape, "layers:stage;batch:data", stack, 2)
    model = pipelined_transformer(config, plan, CPUS[:plan.mesh.size])
    model.compile(keras.optimizers.Adam(), "mse")
    model.optimizer.build(model.trainable_variables)
    predicted = stage_state_bytes(transformer_inventory(config, Mesh.single_device()),
                                  config, plan)
    want = {}
    for s, (weights, optimizer, _) in enumerate(predicted):
        for r, device in enumerate(plan.stage_devices(s)):
            want[device] = weights + optimizer if r == 0 else 0
    got = _device_bytes(model)
    assert {d: got.get(d, 0) for d in want} == want
    # gradients: one per trainable weight, on its stage's device
    grads, seen = [0] * plan.num_stages, set()
    for s, stage in enumerate(model.stages):
        for v in stage.trainable_variables:
            if id(v) not in seen:
                seen.add(id(v))
                grads[s % plan.num_stages] += v.numpy().nbytes
    assert [g for _, _, g in predicted] == grads


def test_the_states_sent_between_stages_are_the_stages_outputs():
    from tfdist.models.transformer_pipeline import pipelined_transformer

    plan = PipelinePlan.from_mesh("stage:3;data:1", "layers:stage;batch:data", 6, 2)
    model = pipelined_transformer(CONFIG, plan, CPUS[:3])
    rows, length = 3, CONFIG.max_length
    ids = tf.ones((rows, length), tf.int32) * 5
    state = (ids, ids)
    for s, stage in enumerate(model.stages[:-1]):
        state = stage(state, training=False)
        floats = sum(int(np.prod(t.shape)) * 4 for t in state.values() if t.dtype.is_floating)
        ints = sum(int(np.prod(t.shape)) * 4 for t in state.values() if t.dtype.is_integer)
        assert _state_after(CONFIG, plan.layers_of(s), rows, length) == (floats, ints), s


def _calibration(n, alpha=1e-4, rate=1e10):
    kinds = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    return Calibration({n: rate}, {(k, g): (alpha, 1e-9) for k in kinds for g in (2, 4)},
                       {n: 1e-3}, {n: 1e-9})


def test_pipelines_are_ranked_with_the_other_layouts():
    plans = pipeline_plans(6, 4, global_batch=16)
    # p | 4 and p | 6: stage:2;data:2 only; m in {2, 4, 8} with 16 rows over 2 replicas
    assert sorted({(str(p.mesh.shape), p.num_microbatches, p.schedule_name) for p in plans}) == [
        ("stage:2;data:2", m, s) for m in (2, 4, 8) for s in ("1f1b", "gpipe")]
    # compute dear, hand-offs cheap: the bubble decides between micro-batch counts
    ranked = plan_layouts(CONFIG, 4, global_batch=16, length=8,
                          calibration=_calibration(4, alpha=1e-7, rate=1e7))
    pipelined = [c for c in ranked.ranked if c.pipeline is not None]
    assert len(pipelined) == 6
    assert "--num_microbatches=" in pipelined[0].flags and "(1f1b, m=" in ranked.table() \
        or "(gpipe, m=" in ranked.table()
    # more micro-batches: a smaller bubble, so a faster predicted step (same schedule)
    one_f = sorted((c.pipeline.num_microbatches, c.step_seconds) for c in pipelined
                   if c.pipeline.schedule_name == "1f1b")
    assert one_f[0][1] > one_f[-1][1]
    # 1F1B stashes fewer micro-batches than GPipe at m = 8
    by = {(c.pipeline.schedule_name, c.pipeline.num_microbatches): c for c in pipelined}
    assert by["1f1b", 8].memory.activations < by["gpipe", 8].memory.activations


def test_a_model_too_big_for_a_device_pipelines_when_stages_fit():
    # Only splitting the stack fits: memory between the pipeline's heaviest stage and
    # the least any data x model layout needs.
    config = dataclasses.replace(CONFIG, moe_experts=0, num_heads=1, d_ff=16)
    ranked = plan_layouts(config, 2, global_batch=8, length=8, calibration=_calibration(2))
    least_mesh = min(c.memory.total for c in ranked.ranked if c.pipeline is None)
    least_pipe = min(c.memory.total for c in ranked.ranked if c.pipeline is not None)
    assert least_pipe < least_mesh
    fitting = plan_layouts(config, 2, global_batch=8, length=8, calibration=_calibration(2),
                           memory_per_device=(least_pipe + least_mesh) // 2)
    assert all(c.pipeline is not None for c in fitting.ranked)
    assert "--layout='layers:stage;batch:data' --num_microbatches=" in fitting.best.flags


def test_micro_batches_the_moe_cannot_route_are_left_out():
    # 8 rows x 8 tokens over m micro-batches: the MoE's groups of 16 tokens need >= 2 rows.
    config = dataclasses.replace(CONFIG, moe_group_size=16)
    ranked = plan_layouts(config, 2, global_batch=8, length=8, calibration=_calibration(2))
    assert sorted({c.pipeline.num_microbatches for c in ranked.ranked if c.pipeline}) == [2, 4]
    assert [why for what, why in ranked.invalid if "m=8" in what] == [
        "a micro-batch of 1 rows x 8 tokens routes 8 tokens, which moe_group_size=16 does "
        "not divide (the MoE would refuse it)."] * 2


def test_a_table_tied_across_stages_is_read_every_micro_batch():
    # Tied embeddings over 2 stages of 1 + 1 blocks: the last stage projects with the
    # table stage 0 holds: m reads of it and one gradient back per step; untied, the
    # target table lives on the stage ending the encoder (0 here) too.
    config = dataclasses.replace(CONFIG, num_encoder_layers=1, num_decoder_layers=1,
                                 moe_experts=0, positions="sinusoidal")
    table = config.vocab_size * config.d_model * 4
    inventory = transformer_inventory(config, Mesh.single_device())
    for m in (2, 4):
        plan = PipelinePlan.from_mesh("stage:2;data:1", "layers:stage;batch:data", 2, m)
        _, work = pipeline_memory_and_work(config, plan, 8, 8, inventory)
        reads = [(c.bytes, c.count) for c in work.collectives if c.bytes == table]
        assert reads == [(table, m), (table, 1)]
