"""Splits the CPU into 8 logical devices before TensorFlow initialises."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfdist.testing.devices import split_cpu  # noqa: E402

NUM_DEVICES = 8
split_cpu(NUM_DEVICES)

