"""Collectives for any shape: resolver memory over many steps and shapes, and per-step cost.

On a 2x2 mesh of virtual CPUs, one traced step runs a tensor-parallel block
(a `psum` and an `all_gather` over "model", whose shapes follow the input's
length) on inputs of unknown length, so its collectives take their keys from
the step's shape id (`tfdist.comm.shape_keys`). Same run:

- memory: 5,000 steps cycling over 8 lengths; the process RSS after every
  500 steps (TF keeps one record per collective and shape, never freed: the RSS
  must stay flat once the 8 shapes are seen);
- baseline: the same number of steps traced with a static length (fixed
  keys), for the RSS drift a process has anyway;
- overhead: the same step at one length, traced with that static length
  (fixed keys, no shape id) against traced with an unknown length (a shape
  id per step), interleaved blocks of steps; the ratio of their medians.

    python bench/shape_keys.py [--steps 5000] [--shapes 8]
"""

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

D, ROWS = 64, 8


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--shapes", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=10)
    args = parser.parse_args()

    from tfdist.devices import split_cpu

    split_cpu(4)
    import numpy as np
    import tensorflow as tf

    from tfdist import collectives
    from tfdist.strategies import MeshStrategy

    strategy = MeshStrategy("data:2;model:2", "batch:data")
    with strategy.scope():
        w = tf.Variable(np.random.default_rng(0).normal(size=(D, D)).astype("float32") / 8)

    def block(x):
        h = collectives.psum(tf.einsum("bld,de->ble", x, w), "model")
        return tf.reduce_sum(collectives.all_gather(h, "model", dim=0))

    def step_fn(signature):
        @tf.function(input_signature=[signature])
        def step(x):
            return strategy.reduce("SUM", strategy.run(block, args=(x,)), axis=None)
        return step

    dynamic = step_fn(tf.TensorSpec((ROWS, None, D), tf.float32))
    lengths = [8 * (i + 1) for i in range(args.shapes)]
    inputs = {n: tf.ones((ROWS, n, D)) for n in lengths}

    # -- memory over steps and shapes ---------------------------------------------
    for n in lengths:
        dynamic(inputs[n]).numpy()
    start = rss_mib()
    marks = []
    for i in range(args.steps):
        out = dynamic(inputs[lengths[i % len(lengths)]])
        if (i + 1) % 500 == 0:
            out.numpy()
            marks.append(rss_mib())
    ids = int(strategy.backend._shape_ids.size().numpy()) - 1
    print(f"memory: {args.steps} steps over {len(lengths)} lengths ({ids} shape ids): RSS "
          f"{start:.1f} MiB after the first step of each shape, then every 500 steps "
          + " ".join(f"{m:.1f}" for m in marks)
          + f"; growth {marks[-1] - marks[0]:+.1f} MiB from step 500 to {args.steps}")

    # -- the same steps with static keys (one shape): the RSS's own drift ----------
    n = lengths[0]
    static = step_fn(tf.TensorSpec((ROWS, n, D), tf.float32))
    static(inputs[n]).numpy()
    base = []
    for i in range(args.steps):
        out = static(inputs[n])
        if (i + 1) % 500 == 0:
            out.numpy()
            base.append(rss_mib())
    print(f"baseline: the same {args.steps} steps with static keys at one length: growth "
          f"{base[-1] - base[0]:+.1f} MiB from step 500 to {args.steps}")

    # -- per-step overhead of the shape id ----------------------------------------
    times = {"static keys": [], "shape id": []}
    for _ in range(args.blocks):
        for name, fn in (("static keys", static), ("shape id", dynamic)):
            t0 = time.perf_counter()
            for _ in range(50):
                out = fn(inputs[n])
            out.numpy()
            times[name].append((time.perf_counter() - t0) / 50 * 1e3)
    medians = {k: statistics.median(v) for k, v in times.items()}
    for name, values in times.items():
        print(f"{name:12s} ms/step min {min(values):.3f} median {medians[name]:.3f} "
              f"max {max(values):.3f}")
    print(f"overhead: shape id / static keys = {medians['shape id'] / medians['static keys']:.3f} "
          f"(+{medians['shape id'] - medians['static keys']:.3f} ms per step; median, "
          f"{args.blocks} interleaved blocks of 50 steps, length {n})")


if __name__ == "__main__":
    main()
