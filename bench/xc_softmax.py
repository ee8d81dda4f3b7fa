"""Sharded softmax head vs a dense head: per-device bytes and step time, same run.

C classes (default 1,000,000), d_model 256, global batch 256, Adam. Dense
baseline: keras Dense(C) + sparse cross-entropy on one device. Sharded:
ShardedSoftmax on a 1xM in-process mesh (classes:model).

Reports per-device bytes of head weights + Adam slots + logits (expect 1/M of
dense) and steps/s with the ratio to the dense head. In-process virtual
devices share this machine's cores, so the step-time ratio here measures
overhead, not scaling; `bench/xc_processes.py` measures the head on
processes pinned to one core each.

    python bench/xc_softmax.py [--num_classes 1000000] [--steps 5]
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfdist.devices import split_cpu  # noqa: E402

split_cpu(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import logging  # noqa: E402

from tfdist.data.xc import synthetic_batch  # noqa: E402
from tfdist.layers import ShardedSoftmax, ShardedSparseCategoricalCrossentropy  # noqa: E402
from tfdist.strategies import MeshStrategy  # noqa: E402
from tfdist.testing.memory import device_bytes  # noqa: E402

D, BATCH = 256, 256


def run(kind, num_classes, mesh, x, y, steps):
    strategy = MeshStrategy(mesh, "classes:model") if mesh else None
    scope = strategy.scope() if strategy else keras.name_scope("dense")
    with scope:
        inputs = keras.Input((D,))
        if kind == "dense":
            model = keras.Model(inputs, keras.layers.Dense(num_classes)(inputs))
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        else:
            model = keras.Model(inputs, ShardedSoftmax(num_classes)(inputs))
            loss = ShardedSparseCategoricalCrossentropy(num_classes)
        model.compile(keras.optimizers.Adam(1e-3), loss)
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)  # trace, warm up
    start = time.perf_counter()
    model.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False)
    speed = steps / (time.perf_counter() - start)
    m = strategy.num_replicas_in_sync if strategy else 1
    logits = BATCH * -(-num_classes // m) * 4  # per device: [batch/M * M rows, C/M] float32
    return device_bytes(model) + logits, speed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num_classes", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    logging.set_verbosity(logging.WARNING)
    x, y = synthetic_batch(np.random.default_rng(0), args.steps * BATCH, args.num_classes, D)
    print(f"XC head bench: C={args.num_classes:,}, d_model {D}, batch {BATCH}, Adam, {args.steps} steps")
    dense_bytes, dense_speed = run("dense", args.num_classes, None, x, y, args.steps)
    print(f"{'head':<22}{'bytes/device':>16}{'ratio':>8}{'steps/s':>9}{'ratio':>8}")
    print(f"{'dense, 1 device':<22}{dense_bytes:>16,}{1:>8.3f}{dense_speed:>9.2f}{1:>8.2f}")
    for mesh in ("data:1;model:2", "data:1;model:4"):
        nbytes, speed = run("sharded", args.num_classes, mesh, x, y, args.steps)
        print(f"{'sharded ' + mesh:<22}{nbytes:>16,}{nbytes / dense_bytes:>8.3f}"
              f"{speed:>9.2f}{speed / dense_speed:>8.2f}")


if __name__ == "__main__":
    main()
