"""Lamb's trust ratio on sharded weights: the norms of the whole weight (the hook's job)."""

import keras
import pytest
from keras.src.optimizers import lamb

from tfdist.internal import keras_lamb
from tfdist.models import build_token_mlp, make_copy_task
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import compare_with_reference


def _report(strategy, optimizer):
    x, y = make_copy_task(3 * 16)
    return compare_with_reference(
        build_token_mlp, strategy, x, y, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=optimizer, batch_size=16, steps=3)


def _keras_lamb():
    """A Lamb with Keras's own `update_step` (the seam's one taken off the instance)."""
    optimizer = keras.optimizers.Lamb(0.01)
    vars(optimizer).pop("update_step", None)
    return optimizer


def test_the_seam_sets_it_on_lambs_created_under_tfdist_only():
    with MeshStrategy("data:2").scope():
        assert keras.optimizers.Lamb().update_step.__func__ is keras_lamb.update_step
    assert keras.optimizers.Lamb().update_step.__func__ is lamb.Lamb.update_step


def test_shard_norms_train_wrong_the_global_norms_train_like_one_device():
    strategy = MeshStrategy("data:1;model:2", "batch:data;d_ff:model;vocab:model")
    wrong = _report(strategy, _keras_lamb)
    right = _report(strategy, lambda: keras.optimizers.Lamb(0.01))
    print(f"Keras's Lamb on shards: {wrong}; with the hook: {right}")
    assert wrong.weights > 1e-3
    assert right.worst() < 1e-5
