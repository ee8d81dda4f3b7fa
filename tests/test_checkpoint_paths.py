"""tfdist.checkpoint's rules without training: names, newest file, the chief writes."""

import os
import types

import numpy as np
import pytest

from tfdist import checkpoint
from tfdist.runtime import MeshRuntime


class _Process(MeshRuntime):
    """A stand-in mesh runtime: chief or not."""

    backend = None

    def __init__(self, chief):
        self._chief = chief

    @property
    def is_chief(self):
        return self._chief


class _Var:
    def __init__(self, path, value):
        self.path, self.value, self.shape = path, np.asarray(value, "float32"), np.shape(value)

    def numpy(self):
        return self.value

    def assign(self, value):
        self.value = np.asarray(value)


def _model(chief=True, value=1.0):
    return types.SimpleNamespace(weights=[_Var("dense/kernel", [[value, 2.0]])], optimizer=None,
                                 distribute_strategy=_Process(chief))


def test_only_the_chief_writes_but_every_process_gathers(tmp_path):
    path = str(tmp_path / "model.npz")
    assert checkpoint.save(_model(chief=False), path) is False
    assert not os.path.exists(path)
    assert checkpoint.save(_model(chief=True), path) is True
    restored = _model(value=0.0)
    checkpoint.load(restored, path)
    np.testing.assert_array_equal(restored.weights[0].value, [[1.0, 2.0]])


def test_backups_are_named_by_epoch_the_newest_kept_and_found(tmp_path):
    run = str(tmp_path)
    backups = checkpoint.Backups(os.path.join(run, checkpoint.BACKUP_DIR))
    assert backups.latest_epoch() == -1 and checkpoint.latest(run) is None
    for epoch in range(3):
        backups.save(_model(value=float(epoch)), epoch)
    assert sorted(os.listdir(backups.directory)) == ["epoch-2.npz"]
    # A temporary file of an interrupted write is not a backup.
    open(os.path.join(backups.directory, ".tmp-abc.npz"), "w").close()
    assert backups.epochs() == {2: os.path.join(backups.directory, "epoch-2.npz")}
    assert checkpoint.latest(run) == backups.path(2)
    checkpoint.save(_model(), checkpoint.final_path(run))
    assert checkpoint.latest(run) == os.path.join(run, "model.npz")  # the final one wins
    backups.delete_all(_Process(chief=False))
    assert backups.latest_epoch() == 2
    backups.delete_all(_Process(chief=True))
    assert backups.latest_epoch() == -1


def test_mid_epoch_backups_are_positions_after_batches(tmp_path):
    backups = checkpoint.Backups(str(tmp_path))
    backups.save(_model(), 0)
    assert backups.latest() == (1, 0)  # resume at epoch 1, batch 0
    backups.save(_model(), 1, 3)
    assert os.listdir(tmp_path) == ["epoch-1-batch-3.npz"] and backups.latest() == (1, 3)
    assert backups.epochs() == {} and backups.latest_epoch() == -1  # no completed epoch kept
    open(os.path.join(tmp_path, "epoch-x-batch-3.npz"), "w").close()  # not a backup
    open(os.path.join(tmp_path, "epoch-1-batch-.npz"), "w").close()
    assert list(backups.positions()) == [(1, 3)]
    assert checkpoint.latest(os.path.dirname(str(tmp_path))) is None  # not a run directory


def test_a_format_is_a_seam(tmp_path):
    class Recording(checkpoint.NpzFormat):
        suffix = ".rec"
        written = []

        def write(self, arrays, path):
            self.written.append(sorted(arrays))
            super().write(arrays, path)

    fmt = Recording()
    backups = checkpoint.Backups(str(tmp_path), fmt)
    backups.save(_model(), 0)
    assert fmt.written == [["dense/kernel"]] and os.listdir(tmp_path) == ["epoch-0.rec"]
    with pytest.raises(FileNotFoundError, match="No checkpoint at"):
        checkpoint.load(_model(), str(tmp_path / "epoch-9.rec"), fmt=fmt)
