"""TF_CONFIG checking and the launcher's commands (no TensorFlow)."""

import json

import pytest

from tfdist.cluster import ClusterConfig
from tfdist.launch.__main__ import parse_args
from tfdist.launch.local import cluster_commands, horovod_command

GOOD = {"cluster": {"worker": ["a:2222", "b:2222"]}, "task": {"type": "worker", "index": 1}}


def test_parses_and_round_trips():
    cluster = ClusterConfig.parse(json.dumps(GOOD))
    assert cluster.tasks == [("worker", 0, "a:2222"), ("worker", 1, "b:2222")]
    assert not cluster.is_controller and cluster.address == "b:2222"
    assert cluster.task_devices(2)[-1] == "/job:worker/replica:0/task:1/device:CPU:1"
    assert ClusterConfig.parse(cluster.to_tf_config()) == cluster
    chief = ClusterConfig.parse({"cluster": {"chief": ["c:1"], "worker": ["a:1"]},
                                 "task": {"type": "chief", "index": 0}})
    assert chief.is_controller and chief.controller == ("chief", 0, "c:1")
    assert ClusterConfig.from_hosts(["a:1", "b:1"], 0).is_controller


@pytest.mark.parametrize(
    "tf_config, fragment",
    [
        ("{not json", "TF_CONFIG is not valid JSON"),
        ({"task": GOOD["task"]}, "has no 'cluster' mapping"),
        ({"cluster": {"ps": ["a:1"]}, "task": GOOD["task"]}, "has job 'ps'"),
        ({"cluster": {"worker": []}, "task": GOOD["task"]}, "lists no workers"),
        ({"cluster": {"worker": ["a"]}, "task": GOOD["task"]}, "Bad address 'a' in job 'worker'"),
        ({"cluster": {"worker": ["a:0"]}, "task": GOOD["task"]}, "port in 1..65535"),
        ({"cluster": {"worker": ["a:1", "a:1"]}, "task": GOOD["task"]}, "'a:1' appears twice"),
        ({"cluster": GOOD["cluster"]}, "must have 'type' and 'index'"),
        ({"cluster": GOOD["cluster"], "task": {"type": "chief", "index": 0}},
         "task type 'chief' is not a job of the cluster ['worker']"),
        ({"cluster": GOOD["cluster"], "task": {"type": "worker", "index": 2}},
         "task index 2 is out of range for job 'worker' of 2 task(s): use 0..1"),
        ({"cluster": {"chief": ["a:1", "b:1"]}, "task": GOOD["task"]}, "2 chiefs"),
    ],
)
def test_broken_tf_config_gives_one_clear_error(tf_config, fragment):
    with pytest.raises(ValueError) as e:
        ClusterConfig.parse(tf_config)
    assert fragment in str(e.value) and "Expected TF_CONFIG like" in str(e.value)


def test_from_env(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert ClusterConfig.from_env() is None
    monkeypatch.setenv("TF_CONFIG", json.dumps(GOOD))
    assert ClusterConfig.from_env().task_index == 1


def test_print_commands_for_hosts():
    lines = cluster_commands(["python", "train.py", "--steps=5"], ["h1", "h2:3333"], 2222, 2)
    assert lines[0].startswith("# on h1\nTF_CONFIG=")
    first = json.loads(lines[0].split("TF_CONFIG=")[1].split("' ")[0].strip("'"))
    assert first == {"cluster": {"worker": ["h1:2222", "h2:3333"]},
                     "task": {"type": "worker", "index": 0}}
    assert "TFDIST_DEVICES_PER_WORKER=2 python train.py --steps=5" in lines[1]
    assert horovod_command(["python", "t.py"], ["h1", "h2"], 8) == \
        "horovodrun -np 16 -H h1:8,h2:8 --gloo python t.py"


@pytest.mark.parametrize(
    "argv, fragment",
    [([], "give the program after `--`"),
     (["--num_workers", "0", "--", "x.py"], "--num_workers must be a positive integer"),
     (["--print", "--", "x.py"], "--print needs --hosts"),
     (["--hosts", "a,b", "--", "x.py"], "add --print")],
)
def test_launcher_argument_errors(argv, fragment, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert fragment in capsys.readouterr().err


def test_the_mesh_over_workers_uses_each_workers_gpus_or_refuses_too_few():
    cluster = ClusterConfig.from_hosts(["localhost:1111", "localhost:2222"], 0)
    cpus = cluster.task_devices(2)
    gpus = cluster.task_devices(2, "GPU")
    assert cluster.choose_devices(2, [], cpus) == cpus
    assert cluster.choose_devices(2, gpus, cpus) == gpus
    assert gpus[3] == "/job:worker/replica:0/task:1/device:GPU:1"
    with pytest.raises(ValueError, match=r"has GPUs but lacks .*task:1/device:GPU:1.*needs 2 GPUs"):
        cluster.choose_devices(2, gpus[:3], cpus)
    with pytest.raises(ValueError, match="every task must run with devices_per_worker=2"):
        cluster.choose_devices(2, [], cpus[:3])
