"""The planner's candidates, cost model, ranking, memory errors and calibration cache."""

import dataclasses
import json

import pytest

from tfdist.config import TransformerConfig
from tfdist.mesh import Mesh
from tfdist.planner import (Calibration, Entry, Inventory, NoLayoutFits, meshes, rank,
                            sequence_meshes)
from tfdist.planner import plan as tfdist_plan
from tfdist.planner.probe import cache_path
from tfdist.planner.search import step_seconds
from tfdist.planner.workload import Collective, Work, gradient_collectives

# A Megatron MLP: d_ff splits, d_model does not.
MLP = Inventory(
    weights=(Entry("mlp/inner/kernel", (64, 256), 4, ("d_model", "d_ff")),
             Entry("mlp/inner/bias", (256,), 4, ("d_ff",)),
             Entry("mlp/outer/kernel", (256, 64), 4, ("d_ff", "d_model")),
             Entry("mlp/norm/gamma", (64,), 4, (None,))),
    optimizer=(Entry("adam/iteration", (), 8, (), False),
               Entry("adam/mlp_inner_kernel_momentum", (64, 256), 4, ("d_model", "d_ff"), False)))


def calibration(alpha=1e-4, beta=1e-9):
    colls = {(k, n): (alpha, beta) for k in ("all_reduce", "all_gather", "reduce_scatter",
                                             "all_to_all") for n in (2, 4)}
    return Calibration({4: 1e10}, colls, {4: 1e-3}, {4: 1e-9}, "test")


def mlp_work(activation_bytes=1000):
    """The MLP's step: gradients summed per shard group; a gather and a reduce-scatter
    of 4 KB each way when d_ff is split."""
    def work(mesh, inventory):
        a = mesh.axis_size(mesh.mesh_axis("d_ff"))
        colls = list(gradient_collectives(inventory, mesh))
        if a > 1:
            colls += [Collective("all_gather", a, 4096, 2), Collective("reduce_scatter", a, 4096 * a, 2)]
        return Work(1e6, tuple(colls), activation_bytes)
    return work


def test_candidates_are_every_data_by_model_mesh_with_the_models_axes():
    got = [(str(m.shape), str(m.rules)) for m in meshes(("d_model", "d_ff", "vocab"), 4)]
    assert got == [("data:4;model:1", "batch:data"),
                   ("data:2;model:2", "batch:data;d_ff:model"),
                   ("data:2;model:2", "batch:data;vocab:model"),
                   ("data:2;model:2", "batch:data;d_ff:model;vocab:model"),
                   ("data:1;model:4", "batch:data;d_ff:model"),
                   ("data:1;model:4", "batch:data;vocab:model"),
                   ("data:1;model:4", "batch:data;d_ff:model;vocab:model")]


def test_gradients_are_summed_over_the_devices_holding_each_shard():
    mesh = Mesh.parse("data:2;model:2", "batch:data;d_ff:model")
    got = gradient_collectives(MLP, mesh)
    # split weights: their halves over the 2 data replicas; the norm over all 4
    assert got == (Collective("all_reduce", 2, (64 * 256 * 2 + 256) * 4 // 2, 1),
                   Collective("all_reduce", 4, 64 * 4, 1))
    buckets = gradient_collectives(MLP, Mesh.parse("data:4", "batch:data"), bucket_bytes=40000)
    assert [(c.count, c.bytes) for c in buckets] == [(4, 33088 * 4 // 4)]  # 33088 floats in 4 buckets


def test_the_step_is_compute_update_and_collectives():
    work = Work(2e10, (Collective("all_gather", 4, 1000, 3),), 0)
    want = 1e-3 + 2e10 / 1e10 + 500 * 1e-9 + 3 * (1e-4 + 1e-9 * 1000)
    assert step_seconds(work, 4, calibration(), update_bytes=500) == pytest.approx(want)
    assert work.bytes_sent == 3 * 3 * 1000  # (n - 1) parts of an all-gather


def test_cheap_collectives_and_room_to_spare_rank_the_split_first():
    plan = rank(meshes(("d_ff",), 4), lambda m: MLP, mlp_work(), calibration(1e-7, 1e-12))
    assert str(plan.best.mesh.rules) == "batch:data;d_ff:model"
    assert str(plan.best.mesh.shape) == "data:1;model:4"  # the least update and gradient work
    assert "data:1;model:4" in plan.table()


def test_expensive_collectives_rank_data_parallelism_first():
    plan = rank(meshes(("d_ff",), 4), lambda m: MLP, mlp_work(), calibration(alpha=1.0))
    assert str(plan.best.mesh.shape) == "data:4;model:1"


def test_tight_memory_leaves_only_layouts_that_split_the_weights():
    whole = sum(e.bytes for e in MLP.weights + MLP.optimizer)
    grads = sum(e.bytes for e in MLP.weights)
    plan = rank(meshes(("d_ff",), 4), lambda m: MLP, mlp_work(0), calibration(alpha=1.0),
                memory_per_device=whole + grads - 1)
    assert all(c.mesh.shape.axis_size("model") > 1 for c in plan.ranked)
    assert [str(c.mesh.shape) for c in plan.too_big] == ["data:4;model:1"]
    assert "(does not fit)" in plan.table()


def test_nothing_fits_names_the_least_memory_that_would():
    with pytest.raises(NoLayoutFits, match=r"memory_per_device=1,000 bytes; the least any takes "
                                           r"is [0-9,]+ bytes per device \(mesh data:1;model:4"):
        rank(meshes(("d_ff",), 4), lambda m: MLP, mlp_work(), calibration(), memory_per_device=1000)


def test_layouts_that_do_not_divide_are_left_out_with_the_reason():
    odd = Inventory((Entry("w", (64, 6), 4, ("d_model", "d_ff")),))
    plan = rank(meshes(("d_ff",), 4), lambda m: odd, mlp_work(), calibration())
    assert [str(c.mesh.shape) for c in plan.ranked] == ["data:4;model:1", "data:2;model:2"]
    (mesh, why), = plan.invalid
    assert "data:1;model:4" in mesh and "does not divide" in why


def test_calibration_is_measured_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("TFDIST_PLANNER_CACHE", str(tmp_path))
    cal = calibration()
    with open(cache_path(), "w") as f:
        json.dump(cal.to_json(), f)
    assert Calibration.from_json(cal.to_json()) == cal

    def no_probe(n):
        raise AssertionError("probed although cached")

    monkeypatch.setattr("tfdist.planner.probe._probe_process", no_probe)
    assert Calibration.measure([4]) == cal
    assert cal.collective_seconds("all_gather", 8, 0) == 1e-4  # the nearest group measured


def test_unequal_devices_favour_data_parallelism_split_by_speed():
    # Equal devices: the split MLP is fastest (cheap collectives, a quarter of the update).
    cal = calibration(1e-7, 1e-12)
    even = rank(meshes(("d_ff",), 4), lambda m: MLP, mlp_work(), cal)
    assert str(even.best.mesh.shape) == "data:1;model:4" and even.best.batch_shares is None
    # One device at a tenth of the speed: a split layout waits for it every step; data
    # parallelism gives it a tenth of the rows.
    slow = rank(meshes(("d_ff",), 4), lambda m: MLP, mlp_work(), cal,
                speeds=[1.0, 1.0, 1.0, 0.1])
    assert str(slow.best.mesh.shape) == "data:4;model:1"
    assert slow.best.batch_shares == pytest.approx((1 / 3.1, 1 / 3.1, 1 / 3.1, 0.1 / 3.1))


def test_sequence_candidates_put_length_on_a_seq_axis_beside_every_data_by_model_mesh():
    got = [(str(m.shape), str(m.rules), method)
           for m, method in sequence_meshes(("d_model", "heads"), 4, methods=("ring",))]
    assert got == [("data:2;seq:2;model:1", "batch:data;length:seq", "ring"),
                   ("data:1;seq:2;model:2", "batch:data;heads:model;length:seq", "ring"),
                   ("data:1;seq:4;model:1", "batch:data;length:seq", "ring"),
                   # Megatron sequence parallelism: length on the heads' model axis
                   ("data:2;model:2", "batch:data;heads:model;length:model", None),
                   ("data:1;model:4", "batch:data;heads:model;length:model", None)]


def test_one_long_row_plans_tensor_parallelism_only_with_megatron_sequence_parallelism():
    """A batch of one row cannot split its rows over a model axis; with its tokens split
    over the heads' axis (length:model) it can, and an MoE over a split is planned too."""
    config = TransformerConfig(vocab_size=256, d_model=64, num_heads=4, d_kv=16, d_ff=128,
                               num_encoder_layers=1, num_decoder_layers=2, max_length=64,
                               dropout=0.0, moe_experts=4, moe_group_size=4)
    plan = tfdist_plan(config, 2, global_batch=1, length=64, calibration=calibration(),
                       pipeline=False)
    layouts = {(str(c.mesh.shape), str(c.mesh.rules), c.sequence_method) for c in plan.ranked}
    assert ("data:1;model:2", "batch:data;heads:model;length:model", None) in layouts
    assert ("data:1;seq:2;model:1", "batch:data;length:seq", "ring") in layouts
    # Without a length split one row fits no 2-device layout.
    assert all("length" in rules for _, rules, _ in layouts), layouts


def test_long_sequences_that_do_not_fit_whole_plan_a_sequence_split():
    """A Transformer at 2048 tokens, 4 rows over 4 devices: attention scores kept whole
    ([b, H, L, L]) do not fit; the plan splits the length (ring or Ulysses), its flags
    name the attention. With 2 rows only the splits that leave 2 row-holders are valid."""
    config = TransformerConfig(vocab_size=256, d_model=64, num_heads=4, d_kv=16, d_ff=128,
                               num_encoder_layers=1, num_decoder_layers=1, max_length=2048,
                               dropout=0.0)
    plan = tfdist_plan(config, 4, global_batch=4, length=2048, memory_per_device=96 << 20,
                       calibration=calibration(), pipeline=False)
    assert plan.ranked and all(c.sequence_method in ("ring", "ulysses") for c in plan.ranked)
    assert plan.best.mesh.mesh_axis("length") == "seq"
    assert f"--sequence_method={plan.best.sequence_method}" in plan.best.flags
    assert f"({plan.best.sequence_method})" in plan.table()
    whole = [c for c in plan.too_big if c.mesh.mesh_axis("length") is None]
    assert len(whole) == 15  # data:4, and heads, d_ff, vocab combined on model:2 and model:4
    # Megatron sequence parallelism keeps the dense scores ([b, H/M, L, L] for b rows of
    # M times as many local tokens: the same bytes): too big as well.
    megatron_sp = [c for c in plan.too_big if c.mesh.mesh_axis("length") == "model"]
    assert len(megatron_sp) == 8  # the combinations with heads on model:2 and model:4
    # the blockwise kernel keeps no scores: a split sequence's activations are far smaller
    assert max(c.memory.activations for c in plan.ranked) * 4 < \
        min(c.memory.activations for c in whole)
    two_rows = tfdist_plan(config, 4, global_batch=2, length=2048, calibration=calibration(),
                           pipeline=False)
    # (and Megatron sequence parallelism over model:2 beside data:2, or model:4: its
    # model axis holds the same rows)
    assert {str(c.mesh.shape) for c in two_rows.ranked} == {"data:2;seq:2;model:1",
                                                            "data:1;seq:2;model:2",
                                                            "data:1;seq:4;model:1",
                                                            "data:2;model:2", "data:1;model:4"}
    assert all(c.mesh.mesh_axis("length") is not None for c in two_rows.ranked)
    reasons = dict(two_rows.invalid)
    assert "global_batch=2 does not divide over the 4 devices" in reasons[
        "mesh data:4;model:1 with layout batch:data"]


def test_sequence_splits_that_cannot_run_are_left_out_with_the_reason():
    config = TransformerConfig(vocab_size=256, d_model=32, num_heads=2, d_kv=8, d_ff=64,
                               num_encoder_layers=1, num_decoder_layers=1, max_length=20,
                               dropout=0.0)
    plan = tfdist_plan(config, 4, global_batch=4, length=20, calibration=calibration(),
                       pipeline=False)
    reasons = dict(plan.invalid)
    # 20 tokens make 2 x 2 chunks, not 2 x 4; 2 heads do not split over Ulysses' 4
    assert "does not split into 2 x 4 zig-zag chunks" in reasons[
        "mesh data:1;seq:4;model:1 with layout batch:data;length:seq (ring)"]
    assert any("data:1;seq:2;model:2" in m and "ulysses" in m and "does not divide" in why
               for m, why in plan.invalid)
    assert any(c.sequence_method == "ulysses" for c in plan.ranked)  # data:2;seq:2
    dropout = tfdist_plan(dataclasses.replace(config, dropout=0.1), 4, global_batch=4,
                          length=20, calibration=calibration(), pipeline=False)
    assert all(c.sequence_method is None for c in dropout.ranked)
    assert any("attention dropout over a sequence split on mesh axis 'seq'" in why for _, why in dropout.invalid)
