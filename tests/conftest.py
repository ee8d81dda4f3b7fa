"""Splits the CPU into 8 logical devices before TensorFlow initialises; shared fixtures.

Tests marked `horovod` need the Horovod build. `make test` builds it in the
background while the other tests run (a new machine's build takes minutes) and
names a status file in `TFDIST_HOROVOD_BUILD_STATUS`: those tests run last
and wait for it; a failed build (or a build that does not import) fails them,
never skips them. Without the variable they are skipped where Horovod is not
built.
"""

import fcntl
import importlib
import os
import pickle
import time

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# One TF thread per pool in every test process (and the jobs it launches, which
# inherit the environment). `make test` runs 3 pytest workers and their job
# processes on 2 cores: TF's default pools (2 threads each, spinning while they
# wait) made in-process replicas hand off slowly beside other processes. Measured
# on tests/strategies with 3 workers: 302 s wall with the default pools, 171 s with
# one thread (CPU 313 s and 301 s); a test of the full suite stalled 159 s for 20
# CPU-s beside Horovod jobs.
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")

from tfdist.devices import split_cpu  # noqa: E402

NUM_DEVICES = 8
split_cpu(NUM_DEVICES)


@pytest.fixture(scope="session")
def computed_once(tmp_path_factory):
    """`computed_once(key, compute)`: `compute()`'s picklable result, computed by one
    pytest-xdist worker per run and read from disk by the others (a file lock)."""
    # Common to every worker of a run: under pytest-xdist each worker's base directory
    # sits in the run's; without it the base directory is the run's own (its parent
    # holds earlier runs', whose results may be stale).
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def get(key, compute):
        path = shared / f"{key}.pickle"
        with open(shared / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not path.exists():
                result = compute()
                with open(path.with_suffix(".partial"), "wb") as f:
                    pickle.dump(result, f)
                os.replace(path.with_suffix(".partial"), path)
                return result
        with open(path, "rb") as f:
            return pickle.load(f)

    return get


@pytest.fixture
def mixed_bfloat16():
    """Keras's global dtype policy `mixed_bfloat16` for one test."""
    import keras

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    yield
    keras.mixed_precision.set_global_policy("float32")


HOROVOD_BUILD_STATUS = os.environ.get("TFDIST_HOROVOD_BUILD_STATUS")


def pytest_collection_modifyitems(items):
    """The Horovod tests last (a stable sort: the others keep their order)."""
    items.sort(key=lambda item: item.get_closest_marker("horovod") is not None)


@pytest.fixture(autouse=True)
def _horovod_built(request):
    if request.node.get_closest_marker("horovod") is None:
        return
    if HOROVOD_BUILD_STATUS:
        deadline = time.monotonic() + 40 * 60
        while not os.path.exists(HOROVOD_BUILD_STATUS) and time.monotonic() < deadline:
            time.sleep(2)
        status = open(HOROVOD_BUILD_STATUS).read().strip() if os.path.exists(
            HOROVOD_BUILD_STATUS) else "still running after 40 minutes"
        if status != "0":
            pytest.fail(f"the Horovod build failed ({status}); see "
                        f"{os.path.splitext(HOROVOD_BUILD_STATUS)[0]}.log")
        importlib.invalidate_caches()
        importlib.import_module("horovod.tensorflow")  # built: it must import, never skip
        return
    pytest.importorskip("horovod.tensorflow", reason="Horovod not built: make horovod")
