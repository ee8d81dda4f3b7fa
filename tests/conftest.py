"""Splits the CPU into 8 logical devices before TensorFlow initialises; shared fixtures."""

import fcntl
import os
import pickle

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfdist.testing.devices import split_cpu  # noqa: E402

NUM_DEVICES = 8
split_cpu(NUM_DEVICES)



@pytest.fixture(scope="session")
def computed_once(tmp_path_factory):
    """`computed_once(key, compute)`: `compute()`'s picklable result, computed by one
    pytest-xdist worker per run and read from disk by the others (a file lock)."""
    shared = tmp_path_factory.getbasetemp().parent  # common to every worker of a run

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
