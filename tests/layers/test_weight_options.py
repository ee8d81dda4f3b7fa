"""Regularizers and constraints on sharded weights: one device's penalty and projection.

A penalty computed on a shard is 1/S of the weight's (S shards); tfdist scales
it so the mesh adds up the whole weight's penalty (`ShardPenalty`), and applies
constraints shard by shard where that is exact, refusing the rest.
"""

import keras
import numpy as np
import pytest

from tfdist.layers import ShardedDense, ShardedEmbedding
from tfdist.models import make_copy_task
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import assert_equivalent

LAYOUT = "batch:data;d_ff:model;vocab:model"
R = keras.regularizers
C = keras.constraints


def _model(out_constraint=None, logits_regularizer=None):
    ids = keras.Input((4,), dtype="int32")
    h = ShardedEmbedding(16, 8, embeddings_regularizer=R.L2(1e-2), name="embed")(ids)
    f = ShardedDense(32, ("d_model", "d_ff"), activation="relu", output_sharded=True,
                     kernel_regularizer=R.L1L2(1e-3, 1e-2), bias_regularizer=R.L2(1e-2),
                     kernel_constraint=C.MaxNorm(0.3, axis=0), name="ffn_in")(h)
    h = h + ShardedDense(8, ("d_ff", "d_model"), input_sharded=True,
                         kernel_regularizer=R.L1(1e-3),
                         kernel_constraint=out_constraint or C.NonNeg(), name="ffn_out")(f)
    logits = ShardedDense(16, ("d_model", "vocab"), kernel_constraint=C.UnitNorm(axis=0),
                          kernel_regularizer=logits_regularizer, name="logits")(h)
    return keras.Model(ids, logits)


@pytest.mark.parametrize("mesh", ["data:1;model:2", "data:2;model:2"])
def test_regularizers_and_constraints_on_shards_match_one_device(mesh):
    x, y = make_copy_task(10 * 16)
    report = assert_equivalent(
        _model, MeshStrategy(mesh, LAYOUT), x, y,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=lambda: keras.optimizers.Adam(0.01), batch_size=16, steps=10, rtol=1e-5)
    print(f"regularizers and constraints on {mesh}: {report}")
    assert report.added_losses < 1e-5  # the penalty of whole weights, not of shards


def test_the_constraints_hold_on_the_mesh_and_the_penalty_is_the_whole_weights():
    x, y = make_copy_task(4 * 16)
    strategy = MeshStrategy("data:2;model:2", LAYOUT)
    with strategy.scope():
        model = _model()
        model.compile(keras.optimizers.Adam(0.05),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert model.get_layer("ffn_out").kernel.numpy().min() >= 0.0  # NonNeg
    assert np.linalg.norm(model.get_layer("ffn_in").kernel.numpy(), axis=0).max() <= 0.3 + 1e-6
    np.testing.assert_allclose(np.linalg.norm(model.get_layer("logits").kernel.numpy(), axis=0),
                               1.0, rtol=1e-5)
    table = model.get_layer("embed").embeddings.numpy()
    penalty = float(sum(keras.ops.convert_to_numpy(l) for l in model.losses))
    expected = (1e-2 * np.square(table).sum()
                + 1e-3 * np.abs(model.get_layer("ffn_in").kernel.numpy()).sum()
                + 1e-2 * np.square(model.get_layer("ffn_in").kernel.numpy()).sum()
                + 1e-2 * np.square(model.get_layer("ffn_in").bias.numpy()).sum()
                + 1e-3 * np.abs(model.get_layer("ffn_out").kernel.numpy()).sum())
    assert penalty == pytest.approx(expected, rel=1e-5)  # read globally: the whole weights


@pytest.mark.parametrize("kwargs, message", [
    ({"out_constraint": C.MaxNorm(1.0, axis=0)},
     r"'ffn_out' weight 'kernel'.*MaxNorm.*norms run over dimension 0, which is split"),
    ({"out_constraint": C.MaxNorm(1.0, axis=-2)}, r"dimension 0, which is split"),
    ({"logits_regularizer": R.OrthogonalRegularizer(0.1)},
     r"'logits' weight 'kernel'.*OrthogonalRegularizer.*sums over elements"),
])
def test_inexact_options_on_shards_are_refused_when_the_model_is_built(kwargs, message):
    with MeshStrategy("data:1;model:2", LAYOUT).scope():
        with pytest.raises(ValueError, match=message):
            _model(**kwargs)
    _model(**kwargs)  # one device: Keras's own handling
