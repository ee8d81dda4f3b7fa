"""TPU launch: argument handling and the construction path, with a mocked TensorFlow."""

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


def test_builds_resolver_connects_and_lays_the_mesh_on_the_cores(monkeypatch):
    monkeypatch.delenv("TFDIST_TPU_ZONE", raising=False)
    tf = _tf(8)
    strategy = tpu_strategy("my-tpu", zone="us-central2-b", project="p",
                            mesh_shape="data:4;model:2", tf=tf)
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver
    resolver.assert_called_once_with(tpu="my-tpu", zone="us-central2-b", project="p")
    tf.config.experimental_connect_to_cluster.assert_called_once_with(resolver.return_value)
    tf.tpu.experimental.DeviceAssignment.build.assert_called_once_with(
        tf.tpu.experimental.initialize_tpu_system.return_value,
        computation_shape=[1, 1, 1, 2], num_replicas=4)
    tf.distribute.TPUStrategy.assert_called_once_with(
        resolver.return_value,
        experimental_device_assignment=tf.tpu.experimental.DeviceAssignment.build.return_value)
    assert strategy is tf.distribute.TPUStrategy.return_value


def test_environment_from_the_launcher_and_clear_errors(monkeypatch):
    monkeypatch.setenv("TFDIST_TPU", "env-tpu")
    monkeypatch.setenv("TFDIST_TPU_ZONE", "z")
    tf = _tf(8)
    tpu_strategy(mesh_shape="data:8", tf=tf)
    tf.distribute.cluster_resolver.TPUClusterResolver.assert_called_once_with(
        tpu="env-tpu", zone="z", project=None)
    with pytest.raises(ValueError, match=r"has 4 devices but 8 devices were found on TPU 'env-tpu'"):
        tpu_strategy(mesh_shape="data:2;model:2", tf=_tf(8))
    with pytest.raises(ValueError, match="must be 1, 2, 4 or 8; received 3"):
        tpu_strategy(mesh_shape="data:4;model:3", tf=_tf(12))
    monkeypatch.delenv("TFDIST_TPU")
    with pytest.raises(ValueError, match="No TPU given"):
        tpu_strategy(tf=_tf())


def test_launcher_tpu_flags(capfd):
    args, command = parse_args(["--tpu", "t", "--tpu_zone", "z", "--", "x.py"])
    assert args.tpu == "t" and command == [sys.executable, "x.py"]
    with pytest.raises(SystemExit):
        parse_args(["--tpu_zone", "z", "--", "x.py"])
    assert "--tpu_zone/--gcp_project need --tpu NAME" in capfd.readouterr().err
    status = main(["--tpu", "t", "--gcp_project", "p", "--", sys.executable, "-c",
                   "import os; print(os.environ['TFDIST_TPU'], os.environ['TFDIST_GCP_PROJECT'])"])
    assert status == 0 and "t p" in capfd.readouterr().out
