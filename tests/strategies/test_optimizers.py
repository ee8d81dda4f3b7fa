"""Keras optimizers and their options on sharded weights: exactly one device's training."""

import keras
import pytest

from tfdist.models import build_token_mlp, make_copy_task
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import assert_equivalent, max_rel_diff

LAYOUT = "batch:data;d_ff:model;vocab:model"
STEPS, BATCH = 6, 16  # accumulation (3) and EMA overwrite (3) act twice

OPTIMIZERS = {
    "sgd_momentum_nesterov": lambda: keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05),
    "lion": lambda: keras.optimizers.Lion(0.001),
    "lamb": lambda: keras.optimizers.Lamb(0.01),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
}


# Lamb and AdamW (norms and decay over every shard) on 2x2; the others, whose
# updates are elementwise, on 1x2 for the suite's time budget.
ON_2X2 = ("lamb", "adamw")


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_matches_one_device_on_a_mesh(name):
    x, y = make_copy_task(STEPS * BATCH)
    mesh = "data:2;model:2" if name in ON_2X2 else "data:1;model:2"
    report = assert_equivalent(
        build_token_mlp, MeshStrategy(mesh, LAYOUT), x, y,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=OPTIMIZERS[name], batch_size=BATCH, steps=STEPS, rtol=1e-5)
    print(f"{name} on {mesh}: {report}")


# Keras applies these inside a tf.cond (tfdist.internal.gradient_seam).
CONDITIONAL = {
    "ema_overwrite": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_overwrite_frequency=3),
    "accumulation": lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=3),
    "accumulation_decay_clipping": lambda: keras.optimizers.SGD(
        0.5, momentum=0.9, weight_decay=0.01, global_clipnorm=0.1, gradient_accumulation_steps=2),
}


# EMA alone and accumulation alone are parts of these two (and run together with
# clipping on LayoutMap weights: tests/distribution/test_model_parallel.py).
@pytest.mark.parametrize("mesh, name", [("data:2;model:2", "accumulation_decay_clipping"),
                                        ("data:1;model:2", "ema_overwrite")])
def test_conditional_updates_on_sharded_weights_match_one_device(mesh, name):
    x, y = make_copy_task(STEPS * BATCH)
    report = assert_equivalent(
        build_token_mlp, MeshStrategy(mesh, LAYOUT), x, y,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=CONDITIONAL[name], batch_size=BATCH, steps=STEPS, rtol=1e-5)
    print(f"{name} on {mesh}: {report}")


@pytest.mark.parametrize("name", ["ema_overwrite", "accumulation"])
def test_the_conditional_options_change_one_devices_training(name):
    # So that matching one device with the option on shows tfdist applied it.
    x, y = make_copy_task(STEPS * BATCH)

    def train(optimizer):
        keras.utils.set_random_seed(0)
        model = build_token_mlp()
        model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        return model.get_weights()

    with_option = train(CONDITIONAL[name]())
    without = train(keras.optimizers.Adam(0.01))
    assert max(max_rel_diff(a, b) for a, b in zip(with_option, without)) > 1e-2


def test_adafactor_is_refused_on_shards():
    x, y = make_copy_task(2 * BATCH)
    strategy = MeshStrategy("data:2;model:2", LAYOUT)
    with strategy.scope():
        model = build_token_mlp()
        model.compile(keras.optimizers.Adafactor(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"Adafactor is not supported for sharded weights"):
        model.fit(x, y, batch_size=BATCH, verbose=0)
    for a, b in zip(model.get_weights(), before):
        assert (a == b).all()  # nothing trained
