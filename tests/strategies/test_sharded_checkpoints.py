"""Sharded checkpoints: each device's shard is written once, nothing is gathered, any mesh reads it."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist import checkpoint
from tfdist.internal import shard_routing
from tfdist.layers.weights import add_sharded_weight
from tfdist.sharded_checkpoint import SHARDED, bundle_prefix
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import max_rel_diff

from token_mlp_2x2 import BATCH, LAYOUT, STEPS, compiled_token_mlp, trained_2x2  # noqa: F401 (a fixture)



def _state(model):
    return model.get_weights() + [v.numpy() for v in model.optimizer.variables]


@pytest.fixture(scope="module")
def trained(trained_2x2, tmp_path_factory):
    """The 2x2 model saved sharded (a spy fails the save if any weight is gathered)."""
    path = str(tmp_path_factory.mktemp("sharded") / "model.shards")
    original = shard_routing.ShardedVariable._get_cross_replica

    def gathered(self):
        raise AssertionError(f"a sharded save gathered {self.name}")

    shard_routing.ShardedVariable._get_cross_replica = gathered
    try:
        assert checkpoint.save(trained_2x2["model"], path, fmt=SHARDED) is True
    finally:
        shard_routing.ShardedVariable._get_cross_replica = original
    return dict(trained_2x2, path=path)


def test_each_shard_is_stored_once_as_its_global_slice(trained):
    stored = SHARDED.tensors(trained["path"])
    model = trained["model"]
    assert stored.shape("ffn1_in/kernel") == (8, 32)
    np.testing.assert_array_equal(stored["ffn1_in/kernel"],
                                  model.get_layer("ffn1_in").kernel.numpy())
    # The 2x2 mesh's kernel shards (d_ff on "model") are two distinct slices, each
    # stored once although two devices (data 0 and 1) hold it.
    data = [f for f in os.listdir(os.path.dirname(bundle_prefix(trained["path"])))
            if ".data-" in f]
    assert len(data) == 1  # one host, one part
    size = os.path.getsize(os.path.join(os.path.dirname(bundle_prefix(trained["path"])), data[0]))
    state_bytes = sum(a.nbytes for a in _state(model))
    assert size < 1.1 * state_bytes, (size, state_bytes)  # not twice: no duplicated slice


@pytest.mark.parametrize("mesh", ["data:1;model:1", "data:4;model:1", "data:1;model:4", "plain"])
def test_load_onto_any_mesh_gives_identical_state_and_training(trained, mesh):
    model = compiled_token_mlp(None if mesh == "plain" else MeshStrategy(mesh, LAYOUT))
    checkpoint.load(model, trained["path"], fmt=SHARDED)
    for a, b in zip(_state(model), _state(trained["model"])):
        np.testing.assert_array_equal(a, b)
    if mesh == "data:1;model:4":
        kernel = model.get_layer("ffn1_in").kernel.value
        assert [tuple(c.shape) for c in kernel.values] == [(8, 8)] * 4
    x, y = trained["x"][STEPS * BATCH:], trained["y"][STEPS * BATCH:]
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    worst = max(max_rel_diff(a, b) for a, b in
                zip(model.get_weights(), trained["reference"].get_weights()))
    assert worst <= 1e-5, worst


def test_a_save_killed_midway_leaves_the_previous_checkpoint(trained, tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.shards")
    model = trained["model"]
    checkpoint.save(model, path, fmt=SHARDED)
    before = SHARDED.read(path)
    merge = tf.raw_ops.MergeV2Checkpoints

    def killed(**kwargs):
        raise KeyboardInterrupt("killed after the parts were written")

    monkeypatch.setattr(tf.raw_ops, "MergeV2Checkpoints", killed)
    model.get_layer("ffn1_in").kernel.assign(model.get_layer("ffn1_in").kernel + 1.0)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(model, path, fmt=SHARDED)
    assert any(f.startswith(".staging-") for f in os.listdir(path))  # the parts were written
    after = SHARDED.read(path)
    assert sorted(after) == sorted(before)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])
    monkeypatch.setattr(tf.raw_ops, "MergeV2Checkpoints", merge)
    checkpoint.save(model, path, fmt=SHARDED)  # the next save completes and cleans up
    assert os.listdir(path) == ["gen-2"]
    np.testing.assert_array_equal(SHARDED.read(path)["ffn1_in/kernel"],
                                  model.get_layer("ffn1_in").kernel.numpy())
    model.get_layer("ffn1_in").kernel.assign(model.get_layer("ffn1_in").kernel - 1.0)


class _Padded(keras.layers.Layer):
    """A weight of 10 rows split over 4 devices: padded to 12, the last shard half padding."""

    def build(self, input_shape):
        self.table = add_sharded_weight(self, "table", (10, 3), ("vocab", None), pad=True,
                                        initializer="glorot_uniform")

    def call(self, x):
        return x


def test_padded_shards_store_and_load_only_real_rows(tmp_path):
    path = str(tmp_path / "padded.shards")
    value = np.arange(30, dtype=np.float32).reshape(10, 3)
    strategy = MeshStrategy("data:1;model:4", "vocab:model")
    with strategy.scope():
        layer = _Padded()
        layer.build(None)
    layer.table.assign(value)
    named = {"table": layer.table}
    SHARDED.save(named, {}, path, strategy)
    assert SHARDED.tensors(path).shape("table") == (10, 3)
    np.testing.assert_array_equal(SHARDED.read(path)["table"], value)
    for mesh in ["data:1;model:2", "data:1;model:4"]:
        other = MeshStrategy(mesh, "vocab:model")
        with other.scope():
            target = _Padded()
            target.build(None)
        SHARDED.load({"table": target.table}, path, other)
        np.testing.assert_array_equal(target.table.numpy(), value)
        last = target.table.value.values[-1].numpy()
        np.testing.assert_array_equal(last[10 - (len(last) * (int(mesh[-1]) - 1)):], 0.0)


def test_backups_in_the_sharded_format(trained, tmp_path):
    backups = checkpoint.Backups(str(tmp_path), SHARDED)
    backups.save(trained["model"], 0)
    backups.save(trained["model"], 1, batch=3)
    os.makedirs(tmp_path / "epoch-4.shards" / ".staging-1")  # an interrupted first save
    assert backups.positions() == {(1, 3): backups.path(1, 3)}
    assert sorted(os.listdir(tmp_path)) == ["epoch-1-batch-3.shards", "epoch-4.shards"]
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        checkpoint.load(trained["model"], str(tmp_path / "epoch-4.shards"), fmt=SHARDED)
    assert checkpoint.format_named("sharded") is SHARDED
    with pytest.raises(ValueError, match="Unknown checkpoint format 'zip'.*'npz', 'sharded'"):
        checkpoint.format_named("zip")
