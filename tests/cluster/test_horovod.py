"""HorovodStrategy under real horovodrun, 2 ranks (skipped where Horovod is not built)."""

import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("horovod.tensorflow", reason="Horovod not built: scripts/install_horovod.sh")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "tests", "cluster", "hvd_job.py")
pytestmark = pytest.mark.slow


def horovodrun(*args, timeout=240):
    runner = shutil.which("horovodrun", path=os.path.dirname(sys.executable)) or "horovodrun"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", HOROVOD_GLOO_TIMEOUT_SECONDS="30")
    return subprocess.run([runner, "-np", "2", "--gloo", "-H", "localhost:2", sys.executable,
                           JOB, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


def ranks(stdout):
    pattern = (r"rank (\d) chief=(\w+): weights rel diff (\S+), checksum (\S+), initial checksum "
               r"(\S+), loss (\S+) vs (\S+), predict rows (\d+) diff (\S+),")
    return {int(m[1]): m.groups()[1:] for m in re.finditer(pattern, stdout)}


@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_matches_one_process_and_ranks_agree(steps_per_execution):
    result = horovodrun("--steps_per_execution", str(steps_per_execution))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    found = ranks(result.stdout)
    assert sorted(found) == [0, 1], result.stdout[-2000:]
    assert found[0][0] == "True" and found[1][0] == "False"
    for chief, diff, checksum, initial, loss, reference, rows, pred_diff in found.values():
        assert float(diff) < 1e-5  # weights after 30 Adam steps
        assert abs(float(loss) - float(reference)) < 1e-5  # evaluate is global
        assert rows == "480" and float(pred_diff) < 1e-5  # predict: all rows, in order
    assert found[0][2] == found[1][2] and found[0][3] == found[1][3]  # same weights on both ranks
    print(result.stdout.strip().splitlines()[-1])


def test_fp16_compression_reports_its_drift():
    result = horovodrun("--compression", "fp16")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    found = ranks(result.stdout)
    drift = float(found[0][1])
    print(f"fp16 gradient compression: weights {drift:.1e} relative from one fp32 process "
          f"after 30 Adam steps")
    assert drift < 0.2 and found[0][2] == found[1][2]


def test_a_killed_rank_ends_the_job_fast_not_hangs():
    import time

    start = time.monotonic()
    result = horovodrun("--die_rank", "1", "--epochs", "1000", timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "rank 1: dying" in result.stdout
    assert elapsed < 90, elapsed  # includes start-up; the survivor fails at once (gloo)
    text = result.stdout + result.stderr
    assert "exited with non-zero status" in text or "Connection" in text, text[-2000:]
    print(f"job ended {elapsed:.0f} s after start (rank 1 killed itself at epoch 1)")


def test_adasum_without_mpi_is_a_clear_error():
    import horovod.tensorflow as hvd

    from tfdist.strategies.horovod import HorovodStrategy

    if hvd.mpi_built():
        pytest.skip("this Horovod has MPI")
    with pytest.raises(ValueError, match="reduction='adasum' needs Horovod built with MPI"):
        HorovodStrategy(reduction="adasum")
