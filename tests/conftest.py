"""Splits the CPU into 8 logical devices before TensorFlow initialises."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfdist.testing.devices import split_cpu  # noqa: E402

NUM_DEVICES = 8
split_cpu(NUM_DEVICES)


def pytest_collection_modifyitems(config, items):
    """Slow tests first (a stable sort), so pytest-xdist's workers end on short tests:
    a long test started last would be the suite's tail, one core idle meanwhile."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
