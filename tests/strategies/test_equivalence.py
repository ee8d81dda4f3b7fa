"""Sharded model vs its single-device Keras reference, over many mesh shapes."""

import keras
import pytest

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


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mesh", MESHES)
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
