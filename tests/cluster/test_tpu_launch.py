"""TPU launch: arguments, the data-parallel-only check and construction, with a mocked TF."""

import sys
from unittest import mock

import pytest

from tfdist.launch.__main__ import main, parse_args
from tfdist.launch.tpu import tpu_strategy


def _tf(cores=8):
    tf = mock.MagicMock(name="tf")
    topology = tf.tpu.experimental.initialize_tpu_system.return_value
    topology.num_tasks, topology.num_tpus_per_task = cores // 4, 4
    return tf


def test_builds_resolver_connects_and_gives_one_replica_per_core(monkeypatch):
    monkeypatch.delenv("TFDIST_TPU_ZONE", raising=False)
    tf = _tf(8)
    strategy = tpu_strategy("my-tpu", zone="us-central2-b", project="p",
                            mesh_shape="data:8", tf=tf)
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver
    resolver.assert_called_once_with(tpu="my-tpu", zone="us-central2-b", project="p")
    tf.config.experimental_connect_to_cluster.assert_called_once_with(resolver.return_value)
    tf.tpu.experimental.initialize_tpu_system.assert_called_once_with(resolver.return_value)
    tf.tpu.experimental.DeviceAssignment.build.assert_not_called()  # the default: a core each
    tf.distribute.TPUStrategy.assert_called_once_with(resolver.return_value)
    assert strategy is tf.distribute.TPUStrategy.return_value
    tpu_strategy("my-tpu", mesh_shape="data:8;model:1", tf=_tf(8))  # size-1 axes are fine


@pytest.mark.parametrize("mesh_shape, other", [("data:4;model:2", "['model:2']"),
                                               ("model:8", "['model:8']"),
                                               ("rows:2;cols:4", "['rows:2', 'cols:4']")])
def test_a_model_axis_fails_before_any_tpu_is_contacted(mesh_shape, other):
    tf = _tf(8)
    with pytest.raises(ValueError) as raised:
        tpu_strategy("my-tpu", mesh_shape=mesh_shape, tf=tf)
    message = str(raised.value)
    assert message.startswith("Only pure data parallelism is supported on TPU today "
                              "(mesh_shape='data:N', one replica per TPU core)")
    assert f"received mesh_shape={mesh_shape!r}, whose axes {other} are not 'data'" in message
    assert "Use mesh_shape='data:8'" in message
    tf.distribute.cluster_resolver.TPUClusterResolver.assert_not_called()
    tf.config.experimental_connect_to_cluster.assert_not_called()
    tf.tpu.experimental.initialize_tpu_system.assert_not_called()


def test_environment_from_the_launcher_and_clear_errors(monkeypatch):
    monkeypatch.setenv("TFDIST_TPU", "env-tpu")
    monkeypatch.setenv("TFDIST_TPU_ZONE", "z")
    tf = _tf(8)
    tpu_strategy(mesh_shape="data:8", tf=tf)
    tf.distribute.cluster_resolver.TPUClusterResolver.assert_called_once_with(
        tpu="env-tpu", zone="z", project=None)
    with pytest.raises(ValueError, match=r"has 4 devices but 8 devices were found on TPU 'env-tpu'"):
        tpu_strategy(mesh_shape="data:4", tf=_tf(8))
    with pytest.raises(ValueError, match="Malformed mesh shape pair 'model'"):
        tpu_strategy(mesh_shape="data:4;model", tf=_tf(8))
    monkeypatch.delenv("TFDIST_TPU")
    with pytest.raises(ValueError, match="No TPU given"):
        tpu_strategy(tf=_tf())


def test_get_strategy_tpu_applies_the_same_check():
    from tfdist.strategies import get_strategy

    tf = _tf(8)
    with pytest.raises(ValueError, match="Only pure data parallelism is supported on TPU today"):
        get_strategy("tpu", tpu="t", mesh_shape="data:4;model:2", tf=tf)
    tf.distribute.cluster_resolver.TPUClusterResolver.assert_not_called()
    assert get_strategy("tpu", tpu="t", mesh_shape="data:8", tf=tf) is \
        tf.distribute.TPUStrategy.return_value


def test_launcher_tpu_flags(capfd):
    args, command = parse_args(["--tpu", "t", "--tpu_zone", "z", "--", "x.py"])
    assert args.tpu == "t" and command == [sys.executable, "x.py"]
    with pytest.raises(SystemExit):
        parse_args(["--tpu_zone", "z", "--", "x.py"])
    assert "--tpu_zone/--gcp_project need --tpu NAME" in capfd.readouterr().err
    status = main(["--tpu", "t", "--gcp_project", "p", "--", sys.executable, "-c",
                   "import os; print(os.environ['TFDIST_TPU'], os.environ['TFDIST_GCP_PROJECT'])"])
    assert status == 0 and "t p" in capfd.readouterr().out
