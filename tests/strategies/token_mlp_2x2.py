"""The token MLP trained on a 2x2 mesh, shared by the checkpoint tests (a fixture to import)."""

import contextlib

import keras
import pytest

from tfdist.models import build_token_mlp, make_copy_task
from tfdist.strategies import MeshStrategy
from tfdist.testing.reference import reference_model

LAYOUT = "batch:data;d_ff:model;vocab:model"
BATCH, STEPS = 16, 5


def token_mlp_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def compiled_token_mlp(strategy=None):
    """The token MLP with Adam built: on `strategy`'s mesh, or a plain Keras model."""
    with (strategy.scope() if strategy else contextlib.nullcontext()):
        model = build_token_mlp() if strategy else reference_model(build_token_mlp())
        model.compile(keras.optimizers.Adam(0.01), token_mlp_loss())
        model.optimizer.build(model.trainable_variables)
    return model


@pytest.fixture(scope="module")
def trained_2x2():
    """A 2x2 model after STEPS Adam steps and a plain model trained uninterrupted for 2 * STEPS."""
    x, y = make_copy_task(2 * STEPS * BATCH)
    keras.utils.set_random_seed(0)
    reference = reference_model(build_token_mlp())
    initial = reference.get_weights()
    reference.compile(keras.optimizers.Adam(0.01), token_mlp_loss())
    reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)  # 2 * STEPS steps
    model = compiled_token_mlp(MeshStrategy("data:2;model:2", LAYOUT))
    model.set_weights(initial)
    model.fit(x[: STEPS * BATCH], y[: STEPS * BATCH], batch_size=BATCH, shuffle=False, verbose=0)
    return dict(x=x, y=y, model=model, reference=reference)
