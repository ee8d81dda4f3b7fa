"""The mesh over Horovod ranks without Horovod: process-set groups, checks, callbacks."""

import types

import keras
import pytest

from tfdist.callbacks import on_chief
from tfdist.comm import horovod as horovod_backend
from tfdist.comm.horovod import HorovodBackend, init_with_process_sets, mesh_groups
from tfdist.mesh import Mesh
from tfdist.runtime import MeshRuntime


def test_groups_are_every_axis_subset_except_single_devices_and_the_whole_mesh():
    assert mesh_groups(Mesh.parse("data:1;model:2")) == []
    assert mesh_groups(Mesh.parse("data:2;model:2")) == [(0, 2), (1, 3), (0, 1), (2, 3)]
    groups = mesh_groups(Mesh.parse("a:2;b:2;c:2"))
    assert (0, 1, 2, 3) in groups and (0, 4) in groups and len(groups) == 4 + 4 + 4 + 2 + 2 + 2


class FakeHorovod:
    Sum, Max, Min = "sum", "max", "min"
    global_process_set = "global"

    def __init__(self, size, initialized=False):
        self._size, self._initialized, self.inits = size, initialized, []

    def is_initialized(self):
        return self._initialized

    def init(self, process_sets=None):
        self.inits.append(process_sets)
        self._initialized = True

    def size(self):
        return self._size

    def ProcessSet(self, ranks):
        return types.SimpleNamespace(ranks=ranks)


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(horovod_backend, "_REGISTERED", {})
    monkeypatch.delenv("HOROVOD_SIZE", raising=False)


def test_init_registers_the_process_sets_once():
    hvd = FakeHorovod(4)
    sets = init_with_process_sets(hvd, Mesh.parse("data:2;model:2"))
    assert sorted(sets) == [(0, 1), (0, 2), (1, 3), (2, 3)]
    assert [ps.ranks for ps in hvd.inits[0]] == [[0, 2], [1, 3], [0, 1], [2, 3]]
    again = init_with_process_sets(hvd, Mesh.parse("data:2;model:2"))  # a second strategy
    assert again == sets and len(hvd.inits) == 1


def test_a_mesh_of_another_size_than_the_ranks_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    with pytest.raises(ValueError, match=r"Mesh shape data:2;model:2 has 4 devices but Horovod "
                                         r"runs 2 ranks .*horovodrun -np 4"):
        init_with_process_sets(FakeHorovod(2), Mesh.parse("data:2;model:2"))


def test_horovod_initialised_elsewhere_without_the_sets_is_a_clear_error():
    with pytest.raises(ValueError, match="create the strategy before anything calls hvd.init"):
        init_with_process_sets(FakeHorovod(4, initialized=True), Mesh.parse("data:2;model:2"))


def test_engine_picks_the_process_set_of_the_group():
    hvd = FakeHorovod(4)
    calls = []
    hvd.allreduce = lambda x, op, process_set, name: calls.append((op, process_set)) or x
    engine = HorovodBackend(hvd, {(0, 2): "ps02"})
    engine.all_reduce(1.0, 0, (0, 2), merge_op="Max")
    engine.all_reduce(1.0, 0, (0, 1, 2, 3))
    assert calls == [("max", "ps02"), ("sum", "global")]
    with pytest.raises(KeyError, match=r"ranks \(0, 3\)"):
        engine.all_reduce(1.0, 0, (0, 3))


def test_on_chief_refuses_a_chief_only_checkpoint_when_reads_are_collective():
    class Rank0WithCollectiveReads(MeshRuntime):  # what HorovodStrategy with a mesh is
        backend = None
        is_chief = True
        collective_weight_reads = True

    strategy = Rank0WithCollectiveReads()
    with pytest.raises(ValueError, match="ModelCheckpoint on the chief alone would hang"):
        on_chief(keras.callbacks.ModelCheckpoint("/tmp/x.weights.h5"), strategy=strategy)
    board = keras.callbacks.TensorBoard("/tmp/logs")
    assert on_chief(board, strategy=strategy) == [board]
