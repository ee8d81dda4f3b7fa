"""MultiWorkerStrategy on two loopback workers: keras#20585 fixed, equivalence, resume, faults."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tfdist.launch.local import free_ports

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "tests", "jobs", "mw_job.py")

pytestmark = pytest.mark.slow


# A guard against hangs: about 2x the job's time alone, which the suite's load doubles.
def launch(*args, timeout=480):
    return subprocess.run([sys.executable, "-m", "tfdist.launch", "--num_workers", "2", "--",
                           JOB, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def results(stdout):
    """Per task: weights rel diff, predict diff, predict rows, loss, reference loss,
    largest history and evaluate differences."""
    found = {}
    for m in re.finditer(r"task (\d) chief=(\w+): weights rel diff (\S+), predict diff (\S+), "
                         r"predict rows (\d+), loss (\S+) vs (\S+), .*history diff (\S+), "
                         r"evaluate diff ([^,\s]+)", stdout):
        found[int(m[1])] = (m[2] == "True", float(m[3]), float(m[4]), int(m[5]), m[6], m[7],
                            float(m[8]), float(m[9]))
    return found


def test_plain_multi_worker_mirrored_strategy_fails_under_keras_3():
    result = launch("--plain")
    assert result.returncode != 0
    assert "Attempt to convert a value (PerReplica" in result.stdout  # keras#20585


def test_fit_evaluate_predict_match_one_process_on_every_worker():
    """37 rows, batch 8 (partial batches split unevenly), sample weights; evaluate's last
    batch is one row, so one worker holds none. The workers' model recomputes its layers
    in the backward pass (`keras.RematScope`); the reference keeps activations."""
    result = launch("--remat")
    assert result.returncode == 0, result.stdout[-3000:]
    found = results(result.stdout)
    assert sorted(found) == [0, 1] and found[0][0] and not found[1][0]  # chief is task 0
    for chief, weights, predict, rows, loss, reference, history, evaluation in found.values():
        assert weights < 1e-5 and predict < 1e-5 and rows == 37
        assert abs(float(loss) - float(reference)) < 1e-5
        assert history < 1e-5 and evaluation < 1e-5
    assert found[0][4] == found[1][4]  # evaluate is global: the same on both workers
    assert re.findall(r"recomputed layers (\d+)", result.stdout) == ["2", "2"]
    print(result.stdout.splitlines()[-1])


def test_a_keras_hub_task_on_raw_strings_matches_one_process_on_every_worker():
    """GemmaCausalLM with its tokenizer, data parallel over 2 workers: fit/evaluate/predict
    and greedy generate on raw strings equal one process (asserted in each task)."""
    result = launch("--keras_hub_task")
    assert result.returncode == 0, result.stdout[-3000:]
    assert sorted(re.findall(r"task (\d) causal_lm: ", result.stdout)) == ["0", "1"]


def test_killed_and_restarted_run_ends_like_an_uninterrupted_one(tmp_path):
    killed = launch("--backup", str(tmp_path), "--die_at_epoch", "2")
    assert killed.returncode == 17, killed.stdout[-2000:]
    assert os.listdir(tmp_path) == ["epoch-1.npz"]  # written by the chief only
    resumed = launch("--backup", str(tmp_path))
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert "resumed from" in resumed.stdout
    for _, weights, *_ in results(resumed.stdout).values():
        assert weights < 1e-5


def test_a_dead_worker_makes_the_other_exit_nonzero_fast():
    ports = free_ports(2)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = []
    for i in range(2):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": i}}))
        procs.append(subprocess.Popen(
            [sys.executable, JOB, "--die_at_epoch", "2", "--die_task", "1", "--epochs", "50"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT))
    try:
        procs[1].communicate(timeout=120)
        died = time.monotonic()
        out, _ = procs[0].communicate(timeout=90)
        elapsed = time.monotonic() - died
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[1].returncode == 17
    assert procs[0].returncode != 0 and elapsed < 60, (elapsed, out[-2000:])
    assert "/job:worker/replica:0/task:1" in out  # names the lost worker
    print(f"survivor exited {elapsed:.1f} s after worker 1 died")
