"""The test that matters: a model that does not fit one capped process trains over two.

Each task of a launched job caps its own address space (`RLIMIT_AS`) at its
idle baseline (measured first, by the same job building no model) plus 90% of
the model's weights and Adam slots. The keras-hub Gemma backbone
(`big_model_job.py`, 1.15 GB of weights and slots) trains tensor parallel
over two pinned processes, saves a sharded checkpoint, and resumes FSDP on
another mesh under the same caps; the same model in one process under the
same cap fails.
"""

import json
import os
import subprocess
import sys

import pytest

from tfdist.testing.memory import RSS_FOLLOWS_TENSORS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "tests", "cluster", "big_model_job.py")
sys.path.insert(0, os.path.dirname(JOB))
from big_model_job import model_bytes  # noqa: E402

MODEL_BYTES = model_bytes()  # weights + Adam's two slots (the job checks the count)
# Address space is what the cap counts: glibc would reserve a 64 MiB arena per thread,
# keep large freed blocks, and oneDNN's allocator would pool freed tensors.
ENV = dict(os.environ, MALLOC_ARENA_MAX="2", TF_CPP_MIN_LOG_LEVEL="2", **RSS_FOLLOWS_TENSORS)

pytestmark = pytest.mark.slow


def launch(workers, *args, caps=None, timeout=600):
    env = dict(ENV, **({"TFDIST_TEST_AS_CAP": json.dumps(caps)} if caps else {}))
    command = [sys.executable, "-m", "tfdist.launch", "--num_workers", str(workers),
               "--pin_cores", "--", JOB, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env)


def run_single(mode, cap=None):
    env = dict(ENV, **({"TFDIST_TEST_AS_CAP": json.dumps([cap])} if cap else {}))
    return subprocess.run([sys.executable, JOB, mode], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)


def report(result, mode):
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    line = next(l for l in result.stdout.splitlines() if f"big_model {mode}: " in l)
    return json.loads(line.split(f"big_model {mode}: ", 1)[1])


def mib(values):
    return [round(v / 2 ** 20) for v in values]


def test_a_model_too_big_for_one_capped_process_trains_saves_and_resumes_over_two(tmp_path):
    idle = report(launch(2, "idle", "1x2"), "idle")["vm_peak"]  # per task
    assert len(idle) == 2
    # (The controller, task 0, also runs the Python program: the larger baseline.)
    caps = [base + int(0.9 * MODEL_BYTES) for base in idle]
    path = str(tmp_path / "gemma.shards")
    trained = report(launch(2, "train", "1x2", path, caps=caps), "train")
    # Weights and slots per process: about half the model (the norms stay whole).
    assert max(trained["device_bytes"]) < 0.55 * MODEL_BYTES
    resumed = report(launch(2, "resume", "2x1", path, caps=caps), "resume")
    assert resumed["restored_max_relative_diff"] < 1e-6
    assert all(loss == loss for loss in resumed["loss"])  # finite, trained on
    alone = report(run_single("single_idle"), "single_idle")["vm_peak"]
    single_cap = alone[0] + int(0.9 * MODEL_BYTES)
    single = run_single("single", cap=single_cap)
    output = single.stdout + single.stderr
    assert single.returncode != 0, output[-3000:]
    assert "big_model single started" in output  # TF and Keras imported under the cap
    # Where the cap bites decides how it fails: a TF allocation, Python, C++, absl.
    assert any(s in output for s in ("ResourceExhausted", "MemoryError", "bad_alloc", "OOM",
                                     "out of memory", "mmap error: 12",
                                     "pthread_create failed")), output[-3000:]
    print(f"model {MODEL_BYTES / 2 ** 20:.0f} MiB of weights + Adam slots; caps "
          f"{mib(caps)} MiB (idle address space {mib(idle)} MiB + 90% of the model); one "
          f"process: {mib([single_cap])} MiB (idle {mib(alone)} MiB + 90%)")
    for name, r in (("train 1x2", trained), ("resume 2x1", resumed)):
        above = [p - b for p, b in zip(r["vm_peak"], idle)]
        print(f"{name}: weights+slots per process {mib(r['device_bytes'])} MiB, peak RSS "
              f"{mib(r['peak_rss'])} MiB, peak address space {mib(r['vm_peak'])} MiB "
              f"({mib(above)} MiB above idle), loss {r['loss']}")
    print("one process under the same cap:", output.strip().splitlines()[-1][:300])
