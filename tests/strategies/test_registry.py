"""`get_strategy`: every option the scripts use, and errors that name the bad value."""

from unittest import mock

import pytest
import tensorflow as tf

from tfdist.cluster import ClusterConfig
from tfdist.mesh import Mesh
from tfdist.strategies import STRATEGY_NAMES, MeshStrategy, get_strategy, registry


def test_names_and_unknown_name():
    assert STRATEGY_NAMES == ("default", "one_device", "mirrored", "mesh", "mesh_cluster",
                              "multi_worker", "averaging", "horovod", "tpu")
    with pytest.raises(ValueError, match=r"Unknown strategy 'meshh': valid strategies are "
                                         r"\['default', 'one_device'"):
        get_strategy("meshh")
    with pytest.raises(ValueError, match=r"Strategy 'default' takes no options \['devices'\]"):
        get_strategy("default", devices=["/cpu:0"])


def test_mesh_from_a_string_or_a_mesh_on_the_given_devices():
    by_string = get_strategy("mesh", mesh_shape="data:2;model:2", layout="d_ff:model",
                             devices=[f"/cpu:{i}" for i in (4, 5, 6, 7)])
    assert isinstance(by_string, MeshStrategy)
    assert by_string.mesh == Mesh.parse("data:2;model:2", "d_ff:model")
    assert [d.split("/")[-1] for d in by_string.devices] == [
        "device:CPU:4", "device:CPU:5", "device:CPU:6", "device:CPU:7"]
    mesh = Mesh.parse("data:2", "batch:data")
    assert get_strategy("mesh", mesh_shape=mesh).mesh is mesh
    with pytest.raises(ValueError, match=r"takes a Mesh \(which has its layout\) or a mesh shape "
                                         r"and a layout, not both; received .*layout='d_ff:model'"):
        get_strategy("mesh", mesh_shape=mesh, layout="d_ff:model")
    with pytest.raises(ValueError, match="Malformed mesh shape pair 'model'"):
        get_strategy("mesh", mesh_shape="data:2;model")


class _Cluster:
    """Stands in for a `ClusterConfig`: records the devices asked for, starts nothing."""

    def __init__(self):
        self.asked = None

    def mesh_devices(self, mesh_size, devices_per_worker):
        self.asked = (mesh_size, devices_per_worker)
        return [f"/cpu:{i}" for i in range(mesh_size)]


def test_mesh_cluster_takes_the_cluster_and_devices_per_worker(monkeypatch):
    cluster = _Cluster()
    strategy = get_strategy("mesh_cluster", mesh_shape=Mesh.parse("data:2;model:2"),
                            cluster=cluster, devices_per_worker=2)
    assert cluster.asked == (4, 2) and strategy.mesh.size == 4 and len(strategy.devices) == 4

    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match=r"'mesh_cluster' needs TF_CONFIG .* or cluster="):
        get_strategy("mesh_cluster", mesh_shape="data:2")
    hosts = ClusterConfig.from_hosts(["localhost:1", "localhost:2"], 0)  # checked before start
    with pytest.raises(ValueError, match="The mesh has 4 devices but the cluster has 2 tasks x 1 "
                                         "devices; use devices_per_worker=2"):
        get_strategy("mesh_cluster", mesh_shape="data:1;model:4", cluster=hosts,
                     devices_per_worker=1)


def test_multi_worker_communication_is_checked_before_anything_starts():
    with pytest.raises(ValueError, match=r"communication must be one of \['auto', 'nccl', 'ring'\]"
                                         r"; received communication='gloo'"):
        get_strategy("multi_worker", communication="gloo")


def test_horovod_takes_a_mesh_as_its_shape_and_rules(monkeypatch):
    made = mock.MagicMock(name="HorovodStrategy")
    monkeypatch.setattr(registry, "horovod_strategy_class", lambda: made)
    mesh = Mesh.parse("data:2;model:2", "batch:data;d_ff:model")
    assert get_strategy("horovod", mesh_shape=mesh, compression="fp16") is made.return_value
    made.assert_called_once_with(mesh_shape=mesh.shape, layout=mesh.rules, compression="fp16")
    get_strategy("horovod")
    made.assert_called_with(mesh_shape=None, layout=None)


def test_tpu_takes_a_mesh_and_passes_its_shape():
    fake_tf = mock.MagicMock(name="tf")
    topology = fake_tf.tpu.experimental.initialize_tpu_system.return_value
    topology.num_tasks, topology.num_tpus_per_task = 1, 4
    strategy = get_strategy("tpu", tpu="t", mesh_shape=Mesh.parse("data:4"), tf=fake_tf)
    assert strategy is fake_tf.distribute.TPUStrategy.return_value


def test_default_one_device_mirrored():
    assert get_strategy("default") is tf.distribute.get_strategy()
    assert get_strategy("one_device").num_replicas_in_sync == 1
    assert get_strategy("mirrored", devices=["/cpu:0", "/cpu:1"]).num_replicas_in_sync == 2
