"""Fault tolerance on one process: resume after a kill, interrupted checkpoint writes."""

import os
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

from tfdist import checkpoint
from tfdist.callbacks import BackupAndRestore, is_chief
from tfdist.strategies import MeshStrategy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(strategy=None):
    keras.utils.set_random_seed(0)
    from tfdist.models import build_token_mlp

    with (strategy.scope() if strategy else keras.name_scope("m")):
        model = build_token_mlp()
        model.compile(keras.optimizers.Adam(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt  # a kill between epochs


def test_resume_after_interruption_equals_uninterrupted_run_on_another_mesh(tmp_path):
    from tfdist.models import make_copy_task

    x, y = make_copy_task(4 * 16)
    uninterrupted = _model()
    uninterrupted.fit(x, y, batch_size=16, epochs=5, shuffle=False, verbose=0)

    first = _model(MeshStrategy("data:2;model:2", "batch:data;d_ff:model;vocab:model"))
    with pytest.raises(KeyboardInterrupt):
        first.fit(x, y, batch_size=16, epochs=5, shuffle=False, verbose=0,
                  callbacks=[BackupAndRestore(str(tmp_path)), _Interrupt(3)])
    assert sorted(os.listdir(tmp_path)) == ["epoch-2.npz"]  # older backups removed

    # Restart on another mesh: picks up after epoch 3 and ends where the uninterrupted run did.
    backup = BackupAndRestore(str(tmp_path))  # Keras's default: deleted at the end
    second = _model(MeshStrategy("data:1;model:4", "batch:data;d_ff:model;vocab:model"))
    history = second.fit(x, y, batch_size=16, epochs=5, shuffle=False, verbose=0, callbacks=[backup])
    assert backup.restored_epoch == 2 and len(history.history["loss"]) == 2
    for a, b in zip(second.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert os.listdir(tmp_path) == [] and is_chief(second.distribute_strategy)


WRITER = """
import sys, numpy as np, keras
from tfdist import checkpoint
model = keras.Sequential([keras.Input((4096,)), keras.layers.Dense(4096, name="d")], name="m")
model.compile("adam", "mse"); model.optimizer.build(model.trainable_variables)
for value in range(1, 1000):
    for w in model.weights:
        w.assign(np.full(w.shape, value, "float32"))
    checkpoint.save(model, sys.argv[1])
    print(value, flush=True)
"""


def test_a_checkpoint_killed_while_being_written_leaves_the_previous_one(tmp_path):
    path = tmp_path / "ckpt.npz"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    try:
        assert proc.stdout.readline().strip() == "1"  # one complete checkpoint exists
        deadline = time.monotonic() + 60
        while not any(n.startswith(".tmp-") for n in os.listdir(tmp_path)):  # mid-write
            assert time.monotonic() < deadline
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    model = keras.Sequential([keras.Input((4096,)), keras.layers.Dense(4096, name="d")], name="m")
    model.compile("adam", "mse")
    model.optimizer.build(model.trainable_variables)
    checkpoint.load(model, str(path))  # complete, not truncated
    value = model.weights[0].numpy().flat[0]
    assert value >= 1 and all((w.numpy() == value).all() for w in model.weights)


class _InterruptAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at, self.epoch = (epoch, batch), 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise KeyboardInterrupt  # a kill in the middle of an epoch


def _nmt(strategy):
    from tfdist.models.transformer import SequenceCrossentropy, Transformer
    from tfdist.models.transformer_layers import TransformerConfig

    keras.utils.set_random_seed(0)
    config = TransformerConfig(vocab_size=32, d_model=16, num_heads=4, d_kv=4, d_ff=32,
                               num_encoder_layers=1, num_decoder_layers=1, max_length=16,
                               dropout=0.3)
    with strategy.scope():
        model = Transformer(config, name="nmt")  # checkpoints key weights by path
        model.compile(keras.optimizers.Adam(1e-2), SequenceCrossentropy(32, 0.0))
    return model


def _nmt_data(n):
    rng = np.random.default_rng(0)
    src = rng.integers(3, 32, size=(n, 8)).astype("int32")
    tgt = np.roll(src, 1, axis=1)
    return (src, np.concatenate([np.ones((n, 1), "int32"), tgt[:, :-1]], 1)), tgt


def test_a_run_killed_mid_epoch_with_dropout_resumes_to_the_uninterrupted_weights(tmp_path):
    mesh = lambda: MeshStrategy("data:2;model:1", "batch:data;heads:model;d_ff:model;vocab:model")
    x, y = _nmt_data(5 * 4)
    fit = dict(batch_size=4, epochs=2, shuffle=False, verbose=0)
    uninterrupted = _nmt(mesh())
    uninterrupted.fit(x, y, **fit)

    first = _nmt(mesh())
    with pytest.raises(KeyboardInterrupt):
        first.fit(x, y, **fit, callbacks=[BackupAndRestore(str(tmp_path), save_freq=3),
                                          _InterruptAt(1, 4)])
    assert os.listdir(tmp_path) == ["epoch-1-batch-3.npz"]  # 3 batches of epoch 1 done
    saved = checkpoint.NPZ.read(str(tmp_path / "epoch-1-batch-3.npz"))
    assert sum(name.startswith("rng/") for name in saved) >= 3  # dropout generators

    trained = []
    backup = BackupAndRestore(str(tmp_path), save_freq=3)
    resumed = _nmt(mesh())
    resumed.fit(x, y, **fit, callbacks=[backup, _CountBatches(trained)])
    assert backup.restored_position == (1, 3) and trained == [3, 4]  # skipped 0-2, no repeat
    assert os.listdir(tmp_path) == []  # delete_checkpoint (Keras's default)
    worst = max(np.max(np.abs(a - b)) for a, b in zip(resumed.get_weights(),
                                                      uninterrupted.get_weights()))
    assert worst < 1e-5

    # The dropout masks matter: resumed from the same backup without its
    # generator states, the run ends elsewhere.
    checkpoint.NPZ.write({n: v for n, v in saved.items() if not n.startswith("rng/")},
                         str(tmp_path / "epoch-1-batch-3.npz"))
    other = _nmt(mesh())
    other.fit(x, y, **fit, callbacks=[BackupAndRestore(str(tmp_path), save_freq=3)])
    assert max(np.max(np.abs(a - b)) for a, b in zip(other.get_weights(),
                                                     uninterrupted.get_weights())) > 1e-3


class _CountBatches(keras.callbacks.Callback):
    def __init__(self, trained):
        super().__init__()
        self.trained = trained

    def on_train_batch_end(self, batch, logs=None):
        if logs:  # a skipped batch reports no logs
            self.trained.append(batch)


def test_save_freq_is_epoch_or_a_positive_number_of_batches(tmp_path):
    for bad in (0, -3, "batch", 2.5, True):
        with pytest.raises(ValueError, match="save_freq must be 'epoch' or a positive integer"):
            BackupAndRestore(str(tmp_path), save_freq=bad)


def test_the_speed_probe_is_the_median_of_five_timed_runs(monkeypatch):
    # The default probe of SpeedProportionalBatches: the median, not the best, of 5 runs
    # (the best of short runs overrates a rank sharing its core; bench/unequal_devices.py).
    from tfdist.callbacks import SpeedProportionalBatches

    probe = SpeedProportionalBatches()
    assert probe._seconds() > 0  # traced and timed for real
    ticks = iter([0.0, 1.0, 1.0, 1.5, 1.5, 9.5, 9.5, 9.7, 9.7, 12.7])  # runs 1, .5, 8, .2, 3
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    assert probe._seconds() == 1.0
