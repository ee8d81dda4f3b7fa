"""Lamb's trust ratio on sharded weights: the norms of the whole weight (the hook's job)."""

import keras
import pytest
from keras.src.optimizers import lamb

from tfdist.internal import keras_lamb
from tfdist.models import build_token_mlp, make_copy_task
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import compare_with_reference


def _report(strategy):
    x, y = make_copy_task(3 * 16)
    return compare_with_reference(
        build_token_mlp, strategy, x, y, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=lambda: keras.optimizers.Lamb(0.01), batch_size=16, steps=3)


def test_the_keras_method_still_exists():
    MeshStrategy("data:2")  # every tfdist mesh strategy installs the hook
    assert keras_lamb.installed()
    assert keras_lamb._KERAS_UPDATE_STEP.__qualname__ == "Lamb.update_step"


def test_shard_norms_train_wrong_the_global_norms_train_like_one_device(monkeypatch):
    strategy = MeshStrategy("data:1;model:2", "batch:data;d_ff:model;vocab:model")
    monkeypatch.setattr(lamb.Lamb, "update_step", keras_lamb._KERAS_UPDATE_STEP)
    wrong = _report(strategy)
    monkeypatch.setattr(lamb.Lamb, "update_step", keras_lamb.update_step)
    right = _report(strategy)
    print(f"Keras's Lamb on shards: {wrong}; with the hook: {right}")
    assert wrong.weights > 1e-3
    assert right.worst() < 1e-5
