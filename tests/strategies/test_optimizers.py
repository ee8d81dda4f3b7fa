"""Keras optimizers and their options on sharded weights: exactly one device's training."""

import keras
import pytest

from tfdist.models import build_token_mlp, make_copy_task
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import assert_equivalent

LAYOUT = "batch:data;d_ff:model;vocab:model"
STEPS, BATCH = 10, 16

OPTIMIZERS = {
    "sgd_momentum_nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "lion": lambda: keras.optimizers.Lion(0.001),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_matches_one_device_on_a_2x2_mesh(name):
    x, y = make_copy_task(STEPS * BATCH)
    report = assert_equivalent(
        build_token_mlp, MeshStrategy("data:2;model:2", LAYOUT), x, y,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=OPTIMIZERS[name], batch_size=BATCH, steps=STEPS, rtol=1e-5)
    print(f"{name}: {report}")


def test_ema_of_replicated_weights_matches_one_device():
    x, y = make_copy_task(STEPS * BATCH)
    report = assert_equivalent(
        build_token_mlp, MeshStrategy("data:2;model:1", LAYOUT), x, y,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=lambda: keras.optimizers.Adam(0.01, use_ema=True),
        batch_size=BATCH, steps=STEPS, rtol=1e-5)
    print(f"adam use_ema on data:2: {report}")


@pytest.mark.parametrize("optimizer", ["Lamb", "Adafactor"])
def test_optimizers_with_per_weight_norms_are_refused_on_shards(optimizer):
    x, y = make_copy_task(2 * BATCH)
    strategy = MeshStrategy("data:2;model:2", LAYOUT)
    with strategy.scope():
        model = build_token_mlp()
        model.compile(getattr(keras.optimizers, optimizer)(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match=rf"{optimizer} is not supported for sharded weights"):
        model.fit(x, y, batch_size=BATCH, verbose=0)


@pytest.mark.parametrize("option, message", [
    ({"use_ema": True}, r"use_ema=True is not supported for sharded weights .*ffn1_in"),
    ({"use_ema": True, "ema_overwrite_frequency": 3},
     r"ema_overwrite_frequency=3 is not supported .*ema_overwrite_frequency=None"),
    ({"gradient_accumulation_steps": 2},
     r"gradient_accumulation_steps=2 is not supported .* 2x larger"),
])
def test_options_not_yet_exact_on_shards_are_refused_before_any_step(option, message):
    x, y = make_copy_task(2 * BATCH)
    strategy = MeshStrategy("data:2;model:2", LAYOUT)
    with strategy.scope():
        model = build_token_mlp()
        model.compile(keras.optimizers.Adam(0.01, **option),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=message):
        model.fit(x, y, batch_size=BATCH, verbose=0)
    for a, b in zip(model.get_weights(), before):
        assert (a == b).all()  # nothing trained
