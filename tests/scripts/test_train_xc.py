"""scripts/train_xc.py: synthetic and XMC-file runs, and clear errors."""

import json
import os

import numpy as np
import pytest

from tfdist.data.xc import prototypes, read_xmc, synthetic_batch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))



@pytest.mark.slow
def test_synthetic_run_learns_writes_outputs_and_sampling_converges(run_script, tmp_path,
                                                                   calibrated):
    result = run_script("train_xc.py", "--num_classes=2000", "--d_model=32", "--steps=40",
                        "--batch_size=64", "--mesh_shape=data:1;model:2", "--eval_examples=1001",
                        "--backup_every=20", "--checkpoint_format=sharded",
                        f"--model_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "head kernel (32, 2000) -> (32, 1000) per device" in result.stdout
    line = next(l for l in result.stdout.splitlines() if l.startswith("held-out"))
    assert "1001 examples" in line  # a partial last batch of 41: every example counts
    top1 = float(line.split()[2].rstrip(","))
    assert top1 > 0.3  # chance is 1/2000
    assert json.load(open(tmp_path / "config.json"))["num_classes"] == 2000
    assert (tmp_path / "model.shards").exists() and os.listdir(tmp_path / "logs")
    assert os.listdir(tmp_path / "backup") == ["epoch-1.shards"]  # the newest of epochs 0, 1

    # Resumed from that backup on another mesh (the head whole on each of 2 devices):
    # only the 20 new steps of a 60-step run train.
    again = run_script("train_xc.py", "--num_classes=2000", "--d_model=32", "--steps=60",
                       "--batch_size=64", "--mesh_shape=data:2;model:1", "--eval_examples=1001",
                       "--backup_every=20", "--checkpoint_format=sharded",
                       f"--model_dir={tmp_path}")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stdout and "Epoch 3/3" in again.stdout
    assert "Epoch 1/3" not in again.stdout and "Epoch 2/3" not in again.stdout
    resumed_top1 = float(next(l for l in again.stdout.splitlines()
                              if l.startswith("held-out")).split()[2].rstrip(","))
    assert resumed_top1 >= top1 - 0.02  # trained on from the backup, not from scratch

    # Class-centre sampling (10% of each shard's classes) lands within a few points; on
    # the layout the planner picks for 2 devices of 800 KiB each: data parallelism
    # (the calibration's favourite) would hold 1.1 MiB, the classes split 0.6 MiB.
    sampled = run_script("train_xc.py", "--num_classes=2000", "--d_model=32", "--steps=40",
                         "--batch_size=64", "--mesh_shape=data:2", "--sample_rate=0.1",
                         "--layout=auto", "--memory_per_device=800KiB")
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    assert "train_xc: --layout=auto chose --mesh_shape='data:1;model:2' " \
           "--layout='batch:data;classes:model'" in sampled.stdout
    assert "data:2;model:1   batch:data" in sampled.stdout and "(does not fit)" in sampled.stdout
    assert "training samples 0.1 of each shard's classes" in sampled.stdout
    line = next(l for l in sampled.stdout.splitlines() if l.startswith("held-out"))
    sampled_top1 = float(line.split()[2].rstrip(","))
    print(f"held-out top-1: full softmax {top1:.3f}, sample_rate 0.1 {sampled_top1:.3f}")
    assert abs(sampled_top1 - top1) < 0.05


def test_xmc_file_run(run_script, tmp_path):
    rng = np.random.default_rng(0)
    for name, n in (("train.txt", 64), ("test.txt", 32)):
        with open(tmp_path / name, "w") as f:
            f.write(f"{n} 6 5\n")
            for _ in range(n):
                label = rng.integers(0, 5)
                f.write(f"{label},{(label + 1) % 5} {label}:1.0 5:{rng.random():.3f}\n")
    result = run_script("train_xc.py", "--num_classes=5", "--steps=30", "--batch_size=16", "--learning_rate=0.1",
                  f"--train_file={tmp_path / 'train.txt'}", f"--test_file={tmp_path / 'test.txt'}")
    assert result.returncode == 0, result.stderr[-2000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("held-out"))
    assert float(line.split()[2].rstrip(",")) > 0.9


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["mesh", "multi_worker"])
def test_runs_over_two_worker_processes(strategy, tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "tfdist.launch", "--num_workers", "2", "--", "scripts/train_xc.py",
         "--num_classes=2000", "--d_model=32", "--steps=20", "--batch_size=64",
         "--eval_examples=1001", f"--strategy={strategy}", f"--model_dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:]
    held_out = [l for l in result.stdout.splitlines() if "held-out top-1" in l]
    # The mesh's controller alone runs the program; data-parallel workers all do.
    assert len(held_out) == (1 if strategy == "mesh" else 2)
    assert float(held_out[0].split("top-1 ")[1].split(",")[0]) > 0.3
    assert all("1001 examples" in line for line in held_out)  # a partial last batch of 41
    if strategy == "mesh":
        assert "(32, 2000) -> (32, 1000) per device" in result.stdout  # one shard per process
    assert sorted(os.listdir(tmp_path)) == ["backup", "config.json", "logs", "model.npz"]


@pytest.mark.parametrize(
    "env, flags, fragment",
    [({"TF_CONFIG": "{broken"}, [], "TF_CONFIG is not valid JSON"),
     ({}, ["--worker_hosts=localhost:1,localhost:2", "--mesh_shape=data:1;model:4"],
      "The mesh has 4 devices but the cluster has 2 tasks x 1 devices"),
     ({}, ["--strategy=multi_worker"], "--strategy=multi_worker needs TF_CONFIG or --worker_hosts")],
)
def test_bad_cluster_gives_one_clear_error(env, flags, fragment, tmp_path, monkeypatch,
                                          assert_one_line_error):
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    result = subprocess.run([sys.executable, "scripts/train_xc.py", *flags],
                            capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**environ, **env})
    assert_one_line_error(result, fragment)


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--train_file=/nonexistent/train.txt", "--test_file=/nonexistent/test.txt"],
         "train_file='/nonexistent/train.txt' does not exist"),
        (["--batch_size=7"], "batch_size=7 does not divide by the 2 devices"),
        (["--sample_rate=1.5"], "sample_rate must be in (0, 1]; received 1.5"),
        (["--mesh_shape=data:1;model"], "Malformed mesh shape pair 'model'"),
        (["--steps=10", "--backup_every=3"],
         "backup_every must be 0 or a positive divisor of steps=10; received backup_every=3"),
        (["--layout=auto", "--memory_per_device=1KiB"],
         "no layout fits in memory_per_device=1,024 bytes; the least any takes is"),
        (["--layout=auto", "--memory_per_device=lots"], "memory size 'lots' is not a positive"),
        (["--layout=auto", "--strategy=horovod"],
         "--layout=auto plans over this machine's devices (--strategy=mesh without a cluster)"),
    ],
)
def test_bad_flags_give_one_clear_error(run_script, flags, fragment, assert_one_line_error,
                                        calibrated):
    result = run_script("train_xc.py", *flags, timeout=120)
    assert_one_line_error(result, fragment)


@pytest.mark.parametrize("line, fragment", [
    ("0 1:x", "train.txt:2: malformed line '0 1:x': could not convert string to float: 'x'"),
    ("zero 1:1", "train.txt:2: malformed line 'zero 1:1'"),
    ("0 7", "train.txt:2: malformed line '0 7'"),
])
def test_a_malformed_data_file_gives_one_clear_error(run_script, tmp_path, line, fragment,
                                                    assert_one_line_error):
    (tmp_path / "train.txt").write_text(f"1 0:1 2:0.5\n{line}\n")
    (tmp_path / "test.txt").write_text("1 0:1\n")
    result = run_script("train_xc.py", f"--train_file={tmp_path / 'train.txt'}",
                        f"--test_file={tmp_path / 'test.txt'}", "--num_classes=4", timeout=120)
    assert_one_line_error(result, fragment)


def test_read_xmc_and_errors(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("2 4 3\n0,2 0:1.5 3:2\n1 1:-1\n")
    x, y = read_xmc(str(path))
    np.testing.assert_array_equal(x, [[1.5, 0, 0, 2], [0, -1, 0, 0]])
    np.testing.assert_array_equal(y, [0, 1])
    path.write_text("0 1:x\n")
    with pytest.raises(ValueError, match=r"data.txt:1: malformed line"):
        read_xmc(str(path))
    with pytest.raises(FileNotFoundError, match="No XMC/libsvm file"):
        read_xmc(str(tmp_path / "missing.txt"))


def test_synthetic_data_is_deterministic_per_class():
    np.testing.assert_array_equal(prototypes([5, 7], 8), prototypes([5, 7], 8))
    x, y = synthetic_batch(np.random.default_rng(0), 256, 1_000_000, 16)
    assert x.shape == (256, 16) and y.min() >= 0 and y.max() < 1_000_000
    assert len(np.unique(y)) < 256  # Zipf: frequent classes repeat
