"""ZeRO (`zero_stage`): optimizer state of replicated weights split over the batch axis, exact.

The single-device reference is plain Keras on one device; nothing of tfdist's
runs in it.
"""

import keras
import numpy as np
import pytest

import tfdist.distribution as td
from tfdist import checkpoint
from tfdist.testing.collective_log import recorded_all_gathers
from tfdist.testing.equivalence import assert_equivalent
from tfdist.testing.memory import device_bytes, optimizer_bytes

from test_model_parallel import functional_layout_map, functional_model, keras_mesh

VOCAB, LENGTH, D = 32, 6, 16


def token_model():
    """Every weight has a dimension that divides by 4 (the logits' bias is 8 wide)."""
    ids = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, D, name="token")(ids)
    x = keras.layers.LayerNormalization(name="ln")(x)
    h = keras.layers.Dense(32, activation="relu", name="up")(x)
    x = x + keras.layers.Dense(D, name="down")(h)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(ids, keras.layers.Dense(8, name="head")(x))


def data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, VOCAB, (n, LENGTH)).astype("int32"),
            rng.integers(0, 8, (n,)).astype("int32"))


def data_parallel(n, stage):
    return td.DataParallel(devices=[f"cpu:{i}" for i in range(n)], zero_stage=stage)


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.parametrize("devices,stage", [(2, 1), (4, 1), (4, 2), (4, 3)])
def test_data_parallel_zero_matches_one_device(devices, stage):
    report = assert_equivalent(token_model, data_parallel(devices, stage), *data(),
                               reference=token_model, loss=loss(),
                               optimizer=lambda: keras.optimizers.Adam(1e-2), batch_size=8,
                               steps=10)
    print(f"ZeRO-{stage} over {devices} devices:", report)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_on_top_of_a_layout_map_matches_one_device(stage):
    """2x2, tensor parallel and FSDP by the map; ZeRO splits the rest over `batch`
    (ZeRO-1 sums a tensor-parallel weight's whole gradient over its shard's owners)."""
    strategy = td.ModelParallel(layout_map=functional_layout_map(keras_mesh((2, 2))),
                                zero_stage=stage)
    x, y = data(80)
    report = assert_equivalent(functional_model, strategy, x, (y % 5), reference=functional_model,
                               loss=loss(), optimizer=lambda: keras.optimizers.Adam(1e-2),
                               batch_size=8, steps=10)
    print(f"ZeRO-{stage} on the 2x2 layout map:", report)
    with strategy.scope():
        model = functional_model()
    mha_kernel = next(v for v in model.weights if v.path == "mha/query/kernel")
    # (16, 4 heads, 4) by the map (None, model, None); ZeRO adds batch on dimension 0.
    assert [tuple(c.shape) for c in mha_kernel.value.values] == [(8, 2, 4)] * 4
    assert [tuple(c.shape) for c in mha_kernel.value._tfdist_kept.copy.values] == [(16, 2, 4)] * 4


def _built(strategy, model_fn=token_model):
    with strategy.scope():
        model = model_fn()
        model.compile(keras.optimizers.Adam(), loss())
        model.optimizer.build(model.trainable_variables)
    return model


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_slots_are_one_nth_per_device_and_weights_kept_whole_below_stage_3(stage):
    reference = _built(data_parallel(1, 0))
    plain = _built(data_parallel(4, 0))
    model = _built(data_parallel(4, stage))
    for v in model.trainable_weights:
        full = tuple(v.shape)
        shard = (full[0] // 4,) + full[1:]
        assert [tuple(c.shape) for c in v.value.values] == [shard] * 4, v.path
        kept = v.value._tfdist_kept
        if stage < 3:
            assert [tuple(c.shape) for c in kept.copy.values] == [full] * 4, v.path
        else:
            assert kept is None
    slots = [optimizer_bytes(model, i) for i in range(4)]
    scalars = sum(np.dtype(v.dtype).itemsize for v in reference.optimizer.variables
                  if len(v.shape) == 0)  # the iteration counter and learning rate, whole
    assert slots == [(optimizer_bytes(reference, 0) - scalars) // 4 + scalars] * 4
    assert optimizer_bytes(plain, 0) == optimizer_bytes(reference, 0)
    weights = sum(w.size * 4 for w in reference.get_weights())
    expected = weights + weights // 4 if stage < 3 else weights // 4  # copy + shard, or shard
    assert device_bytes(model, 0) - slots[0] == expected
    print(f"ZeRO-{stage}, 4 devices: weights+copy {device_bytes(model, 0) - slots[0]} B, "
          f"slots {slots[0]} B per device; plain data parallel: weights {weights} B, slots "
          f"{optimizer_bytes(plain, 0)} B")


def test_stages_1_and_2_read_their_kept_copies_and_gather_once_per_step():
    """ZeRO-1/2 all-gather every weight's new shard once per step, all in one flat
    buffer (into the copies); ZeRO-3 gathers each weight on every read (Dense and
    Embedding again for the backward pass); plain data parallelism never."""
    x, y = data(8)
    counts = {}
    for stage in (0, 1, 2, 3):
        strategy = data_parallel(2, stage)
        model = _built(strategy)
        with recorded_all_gathers(strategy) as shapes:
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        shards = [(1,) + tuple(v.value.values[0].shape) for v in model.trainable_weights]
        flat = (1, 1, sum(int(np.prod(s)) for s in shards))
        # (one gather per replica: both replicas run in this process; the Embedding's
        # sparse ZeRO-2 gradient gathers its ids and rows: other shapes)
        counts[stage] = (sum(s in set(shards) for s in shapes), shapes.count(flat))
    assert counts[0] == (0, 0)
    assert counts[1] == (0, 2) and counts[2] == (0, 2)
    assert counts[3][0] > len(model.trainable_weights) * 2 and counts[3][1] == 0
    print({stage: c for stage, c in counts.items()}, "(weight gathers, flat gathers) per step")


def _fit(model, x, y, optimizer, batch_size=8, epochs=1):
    model.compile(optimizer, loss())
    return model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
                     verbose=0).history["loss"]


@pytest.mark.parametrize("stage", [1, 2])
def test_training_options_and_a_partial_last_batch_match_one_device(stage):
    """global_clipnorm, EMA with overwrite (an assignment outside the update: the copy
    follows it), gradient accumulation and a 4-row last batch, ZeRO-1 and 2 over 4."""
    x, y = data(76)

    def optimizer():
        return keras.optimizers.Adam(1e-2, global_clipnorm=0.05, use_ema=True,
                                     ema_momentum=0.9, ema_overwrite_frequency=3,
                                     gradient_accumulation_steps=2)

    keras.utils.set_random_seed(0)
    reference = token_model()
    strategy = data_parallel(4, stage)
    with strategy.scope():
        model = token_model()
        model.set_weights(reference.get_weights())
        curve = _fit(model, x, y, optimizer(), epochs=2)
    reference_curve = _fit(reference, x, y, optimizer(), epochs=2)
    np.testing.assert_allclose(curve, reference_curve, rtol=1e-5)
    for a, b in zip(model.get_weights() + [v.numpy() for v in model.optimizer.variables],
                    reference.get_weights() + [v.numpy() for v in reference.optimizer.variables]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0),
                               rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("suffix", [".weights.h5", ".shards"])
def test_a_loaded_checkpoint_reaches_the_kept_copies(tmp_path, suffix):
    """Saved from ZeRO-2 over 4, loaded into ZeRO-2 over 2 and into plain Keras: the
    predictions (read from the kept copies) are the saved model's."""
    x, y = data(32)
    model = _built(data_parallel(4, 2))
    model.fit(x, y, batch_size=8, verbose=0)
    expected = model.predict(x, verbose=0)
    path = str(tmp_path / f"model{suffix}")
    if suffix == ".shards":
        checkpoint.save(model, path)
    else:
        model.save_weights(path)
    other = _built(data_parallel(2, 2))
    plain = token_model()
    for target in (other, plain):
        if suffix == ".shards":
            checkpoint.load(target, path, with_optimizer=False)
        else:
            target.load_weights(path)
        np.testing.assert_allclose(target.predict(x, verbose=0), expected, rtol=1e-5, atol=1e-6)


def test_a_bad_zero_stage_is_one_clear_error():
    with pytest.raises(ValueError, match=r"zero_stage must be 0 .*received zero_stage=4"):
        data_parallel(2, 4)
