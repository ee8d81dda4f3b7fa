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
    backup = BackupAndRestore(str(tmp_path), delete_on_end=True)
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
