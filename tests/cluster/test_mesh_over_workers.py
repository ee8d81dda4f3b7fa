"""A mesh over worker processes on loopback: equivalence, launcher, faults."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tfdist.launch.local import free_ports

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "tests", "jobs", "mesh_job.py")

pytestmark = pytest.mark.slow


# A guard against hangs, not a time budget: the 2x1 job takes 150 s alone and over 300 s
# under the suite's three pytest workers on 2 cores (CI, 2026-12-05).
def launch(*args, timeout=900):
    return subprocess.run([sys.executable, "-m", "tfdist.launch", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)



@pytest.mark.parametrize("workers, devices, mesh, cases", [
    # sharded_options and fit_options over processes: tests/cluster/test_horovod.py's
    # mesh jobs (the suite's time budget). keras_options trains the token MLP.
    # remat: recomputation over processes, the model axis across them (collectives
    # re-run in the backward pass). In the 2x2 job, once (1 of 3 runs, 2026-12-02)
    # worker 1 aborted in TF's C++ (std::length_error, basic_string::_M_create) as
    # its first graph ran; not reproduced in 5 runs since (alone or after the other
    # cases), not understood, so it stays out of the 2x2 job.
    (2, 1, "data:1;model:2",
     "xc_head,plain_embedding,keras_options,mixed_bfloat16,partial_batches,remat"),
    # pipeline: two stages, one per process (activations cross processes).
    # sequence: a causal LM with `length` split over the two processes (ring, Ulysses).
    # A job of their own: with the cases above one job took 303 s of wall time in a full
    # run (over 300 s in CI), half of pytest's 600 s limit per test.
    (2, 1, "data:1;model:2", "pipeline,sequence"),
    # zero: ZeRO-2 over the 4 devices of the 2 workers.
    (2, 2, "data:2;model:2", "token_mlp,xc_head,plain_embedding,sharded_checkpoint,zero"),
])
def test_mesh_over_two_workers_matches_single_device(workers, devices, mesh, cases):
    result = launch("--num_workers", str(workers), "--devices_per_worker", str(devices), "--",
                    JOB, mesh, cases)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "'/job:worker/replica:0/task:0', '/job:worker/replica:0/task:1'" in result.stdout
    for name in cases.split(","):
        line = next(l for l in result.stdout.splitlines() if f"] {name} {mesh}:" in l)
        print(line)
        assert "weights after " in line  # the job's assertions passed
    assert f"] averaging {mesh}: period 1 SGD vs synchronous SGD" in result.stdout


def test_a_keras_hub_task_on_raw_strings_over_two_workers_matches_one_device():
    # GemmaCausalLM and its tokenizer built under the scope; keras-hub maps the tokenizer
    # over the controller's tf.data pipeline. Without tfdist.internal.single_controller
    # the tokenizer's SentencePiece resource is on worker 0 and distributing the pipeline
    # fails ("Trying to access resource _1_SentencepieceOp located in device
    # /job:worker/replica:0/task:0/device:CPU:0 from device /job:localhost/...").
    mesh = "data:1;model:2"
    result = launch("--num_workers", "2", "--", JOB, mesh, "keras_hub_causal_lm")
    assert result.returncode == 0, result.stdout[-3000:]
    line = next(l for l in result.stdout.splitlines() if f"] keras_hub_causal_lm {mesh}:" in l)
    print(line)
    assert "'generate': [" in line  # the job's assertions passed
    assert f"] averaging {mesh}: period 1 SGD vs synchronous SGD" in result.stdout


def test_launcher_ends_the_others_with_the_first_failure(tmp_path):
    # Worker 1 fails only once worker 0 is up (a loaded machine may start them far apart).
    flag = tmp_path / "worker0"
    script = ("import json, os, sys, time\n"
              "i = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
              "print('started', flush=True)\n"
              f"if i == 0: open({str(flag)!r}, 'w').close(); time.sleep(120)\n"
              f"while not os.path.exists({str(flag)!r}): time.sleep(0.05)\n"
              "sys.exit(3)\n")
    start = time.monotonic()
    result = launch("--num_workers", "2", "--", sys.executable, "-c", script, timeout=60)
    assert result.returncode == 3
    assert time.monotonic() - start < 30
    assert "[worker 0] started" in result.stdout and "[worker 1] started" in result.stdout
    assert "worker 1 exited with status 3; ending the others" in result.stdout


def test_a_killed_worker_makes_the_controller_fail_fast_not_hang():
    ports = free_ports(2)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = []
    for i in range(2):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster,
                                                     "task": {"type": "worker", "index": i}}),
                   TF_CPP_MIN_LOG_LEVEL="2")
        procs.append(subprocess.Popen([sys.executable, JOB, "data:1;model:2", "--steps_forever"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, cwd=ROOT))
    controller, worker = procs
    try:
        lines = []
        for line in controller.stdout:  # wait until it trains
            lines.append(line)
            if line.startswith("training"):
                break
        time.sleep(3)
        worker.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        out, _ = controller.communicate(timeout=90)
        elapsed = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    text = "".join(lines) + out
    assert controller.returncode != 0, text[-2000:]
    assert elapsed < 60, elapsed
    # Names the lost worker: tfdist's watcher by address, or (when gRPC's reset
    # arrives first, before the watcher's 6 s) TF's error by task.
    assert f":{ports[1]}" in text or "/job:worker/replica:0/task:1" in text, text[-2000:]
    print(f"controller failed {elapsed:.1f} s after the kill: "
          f"{[l for l in text.splitlines() if 'lost' in l or 'Error' in l][-1:]}")
