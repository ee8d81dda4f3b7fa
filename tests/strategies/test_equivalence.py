"""Sharded model vs its single-device Keras reference, over many mesh shapes."""

import functools

import keras
import pytest

from tfdist.layers import ShardedDense
from tfdist.models import build_token_mlp, make_copy_task
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import assert_equivalent

MESHES = [
    "data:1;model:1",
    "data:2;model:1",
    "data:1;model:2",
    "data:2;model:2",
    "data:4;model:1",
    "data:1;model:4",
    "data:2;model:4",
]
LAYOUT = "batch:data;d_ff:model;vocab:model"
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "adam": lambda: keras.optimizers.Adam(0.01),
}
STEPS, BATCH = 20, 16


# Adam on every mesh but 1x1 (the reference itself) and 2x4 (8 replicas: 2x2 and
# 1x4 cover its paths); plain SGD (no slots) on a model-parallel mesh. All pass;
# the suite's time budget.
CASES = [(mesh, "adam") for mesh in MESHES if mesh not in ("data:1;model:1", "data:2;model:4")] \
    + [("data:1;model:4", "sgd")]


@pytest.mark.parametrize("mesh, optimizer", CASES)
def test_token_mlp_matches_single_device(mesh, optimizer):
    x, y = make_copy_task(STEPS * BATCH)
    report = assert_equivalent(
        build_token_mlp,
        MeshStrategy(mesh, LAYOUT),
        x,
        y,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=OPTIMIZERS[optimizer],
        batch_size=BATCH,
        steps=STEPS,
        rtol=1e-5,
    )
    print(f"{mesh} {optimizer}: {report}")


def _tied_mlp():
    """One column-parallel layer applied twice: its gradient is a sum of two reads."""
    x = inputs = keras.Input((8,))
    shared = ShardedDense(8, ("d_model", "d_ff"), activation="tanh", name="shared")
    y = ShardedDense(4, ("d_model", "vocab"), name="head")(shared(shared(x)))
    return keras.Model(inputs, y)


@pytest.mark.parametrize("mesh", ["data:1;model:2", "data:2;model:2"])
def test_tied_weights_and_loss_scaling_match_single_device(mesh):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(10 * BATCH, 8)).astype("float32")
    y = rng.normal(size=(10 * BATCH, 4)).astype("float32")
    report = assert_equivalent(
        _tied_mlp,
        MeshStrategy(mesh, LAYOUT),
        x,
        y,
        loss=keras.losses.MeanSquaredError(),
        optimizer=lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01)),
        batch_size=BATCH,
        steps=10,
        rtol=1e-5,
    )
    print(f"{mesh} tied + loss scaling: {report}")


@pytest.mark.parametrize("mesh", ["data:1;model:2", "data:2;model:2"])  # + over ranks
def test_a_plain_keras_embedding_beside_sharded_layers_matches_single_device(mesh):
    x, y = make_copy_task(STEPS * BATCH)
    report = assert_equivalent(
        functools.partial(build_token_mlp, plain_embedding=True), MeshStrategy(mesh, LAYOUT), x, y,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=OPTIMIZERS["adam"], batch_size=BATCH, steps=STEPS, rtol=1e-5)
    print(f"{mesh} plain Embedding: {report}")



def test_the_harness_refuses_lists_of_other_lengths_instead_of_comparing_a_prefix():
    from tfdist.testing.equivalence import _same_length

    _same_length("optimizer variables", [1, 2], [3, 4])
    with pytest.raises(AssertionError, match="the model has 2 optimizer variables, its reference 3"):
        _same_length("optimizer variables", [1, 2], [1, 2, 3])
