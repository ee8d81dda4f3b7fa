"""Checkpoints hold global tensors: train on 2x2, resume on any mesh or plain Keras."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist import checkpoint
from tfdist.models import build_token_mlp
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import max_rel_diff
from tfdist.testing.reference import reference_model

from token_mlp_2x2 import BATCH, LAYOUT, STEPS, compiled_token_mlp, trained_2x2  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def trained(trained_2x2, tmp_path_factory):
    """The 2x2 model, its Keras and portable checkpoints, and the uninterrupted reference."""
    model = trained_2x2["model"]
    directory = tmp_path_factory.mktemp("ckpt")
    path = str(directory / "model.weights.h5")
    model.save_weights(path)
    portable = str(directory / "model.npz")
    checkpoint.save(model, portable)
    return dict(trained_2x2, path=path, portable=portable, tmp=tmp_path_factory.mktemp("keras"))


@pytest.mark.parametrize(
    "mesh, fmt",
    [("data:1;model:1", "keras"), ("data:4;model:1", "keras"), ("data:1;model:4", "keras"),
     ("data:1;model:4", "portable"), ("plain", "portable")],
)
def test_resume_on_another_mesh_continues_identically(trained, mesh, fmt):
    model = compiled_token_mlp(None if mesh == "plain" else MeshStrategy(mesh, LAYOUT))
    if fmt == "keras":
        model.load_weights(trained["path"])
    else:
        checkpoint.load(model, trained["portable"])
    for a, b in zip(model.get_weights(), trained["model"].get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(model.optimizer.variables, trained["model"].optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    x, y = trained["x"][STEPS * BATCH:], trained["y"][STEPS * BATCH:]
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    worst = max(max_rel_diff(a, b) for a, b in
                zip(model.get_weights(), trained["reference"].get_weights()))
    assert worst <= 1e-5, worst


def test_keras_file_round_trip_onto_another_mesh(trained):
    path = str(trained["tmp"] / "model.keras")
    trained["model"].save(path)
    strategy = MeshStrategy("data:1;model:4", LAYOUT)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    kernel = loaded.get_layer("ffn1_in").kernel
    assert [tuple(c.shape) for c in kernel.value.values] == [(8, 8)] * 4
    for a, b in zip(loaded.get_weights(), trained["model"].get_weights()):
        np.testing.assert_array_equal(a, b)
    x = trained["x"][:BATCH]
    np.testing.assert_allclose(loaded.predict(x, verbose=0),
                               trained["model"].predict(x, verbose=0), rtol=1e-5, atol=1e-6)
    single = keras.models.load_model(path)  # no strategy: one device
    np.testing.assert_allclose(single.predict(x, verbose=0),
                               trained["model"].predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_tf_train_checkpoint_saves_global_tensors(trained, tmp_path):
    source = trained["model"]
    prefix = tf.train.Checkpoint(model=source).write(str(tmp_path / "tf_ckpt"))
    target = compiled_token_mlp(MeshStrategy("data:1;model:4", LAYOUT))
    tf.train.Checkpoint(model=target).read(prefix).expect_partial()
    for a, b in zip(target.get_weights(), source.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_portable_checkpoint_errors_name_the_problem(trained, tmp_path):
    model = reference_model(build_token_mlp(d_ff=16))
    with pytest.raises(ValueError, match=r"ffn1_in/kernel: model \(8, 16\) vs checkpoint \(8, 32\)"):
        checkpoint.load(model, trained["portable"], with_optimizer=False)
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        checkpoint.load(model, str(tmp_path / "missing.npz"))


def test_interrupted_portable_write_keeps_the_previous_checkpoint(trained, tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.npz")
    checkpoint.save(trained["model"], path)
    before = open(path, "rb").read()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(np, "savez", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(trained["model"], path)
    assert open(path, "rb").read() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.npz"]
