"""XC head step time across processes, each pinned to one core, same run.

Baseline: a Keras Dense(C) head + SparseCategoricalCrossentropy in one
process pinned to one core (one thread). Against it: ShardedSoftmax on a
`data:1;model:M` mesh over M processes, process i pinned to core i (one
thread each), all classes and with class-centre sampling 0.1. C = 1,000,000,
d_model 256, global batch 256, Adam (the issue's setting). Each case is a
fresh job started with tfdist.launch; the table reports steps/s, the speed-up
over the dense head and the scaling efficiency (speed-up / M).

    python bench/xc_processes.py [--num_classes 1000000] [--steps 3] [--processes 2]
"""

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

D, BATCH = 256, 256


def job(args):
    """One case, run in every task of a launched job; the controller measures."""
    import time

    from tfdist.cluster import ClusterConfig

    devices = ClusterConfig.from_env().start(threads=1)
    import keras
    import numpy as np
    import tensorflow as tf
    from absl import logging

    from tfdist.data.xc import synthetic_batch
    from tfdist.layers import ShardedSoftmax, ShardedSparseCategoricalCrossentropy
    from tfdist.strategies import MeshStrategy

    logging.set_verbosity(logging.WARNING)
    C = args.num_classes
    x, y = synthetic_batch(np.random.default_rng(0), (args.steps + 1) * BATCH, C, D)
    if args.case == "dense":
        strategy = tf.distribute.OneDeviceStrategy(devices[0])
    else:
        strategy = MeshStrategy(f"data:1;model:{len(devices)}", "classes:model", devices=devices)
    with strategy.scope():
        inputs = keras.Input((D,))
        if args.case == "dense":
            model = keras.Model(inputs, keras.layers.Dense(C)(inputs))
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            fit_x = x
        else:
            rate = 0.1 if args.case == "sampled" else 1.0
            head = ShardedSoftmax(C, sample_rate=rate)
            if rate < 1:
                labels = keras.Input((), dtype="int32")
                model = keras.Model([inputs, labels], head(inputs, labels=labels))
                fit_x = (x, y)
            else:
                model = keras.Model(inputs, head(inputs))
                fit_x = x
            loss = ShardedSparseCategoricalCrossentropy(C) if rate == 1 else None  # sampled: add_loss
        model.compile(keras.optimizers.Adam(1e-3), loss)
    first = (fit_x[0][:BATCH], fit_x[1][:BATCH]) if isinstance(fit_x, tuple) else fit_x[:BATCH]
    rest = (fit_x[0][BATCH:], fit_x[1][BATCH:]) if isinstance(fit_x, tuple) else fit_x[BATCH:]
    model.fit(first, y[:BATCH], batch_size=BATCH, verbose=0)  # trace, warm up
    start = time.perf_counter()
    model.fit(rest, y[BATCH:], batch_size=BATCH, verbose=0, shuffle=False)
    seconds = (time.perf_counter() - start) / args.steps
    with open(args.result, "w") as f:
        json.dump({"case": args.case, "processes": len(devices), "s_per_step": seconds}, f)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num_classes", type=int, default=1_000_000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--case", choices=["dense", "sharded", "sampled"])
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.case:
        return job(args)
    from tfdist.launch.local import run_local

    print(f"XC head across processes: C={args.num_classes:,}, d_model {D}, batch {BATCH}, "
          f"Adam, {args.steps} timed steps, one core and one thread per process")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case, n in (("dense", 1), ("sharded", args.processes), ("sampled", args.processes)):
            path = os.path.join(tmp, f"{case}.json")
            command = [sys.executable, os.path.abspath(__file__), f"--case={case}",
                       f"--num_classes={args.num_classes}", f"--steps={args.steps}",
                       f"--result={path}"]
            status = run_local(command, n, pin_cores=True, linger_s=2.0, out=open(os.devnull, "w"))
            if status or not os.path.exists(path):
                print(f"{case}: the job failed (status {status})")
                return 1
            results[case] = json.load(open(path))
    base = results["dense"]["s_per_step"]
    print(f"{'head':<34}{'processes':>10}{'s/step':>9}{'speed-up':>10}{'efficiency':>12}")
    for case, label in (("dense", "dense Keras head"), ("sharded", "ShardedSoftmax"),
                        ("sampled", "ShardedSoftmax, sample_rate 0.1")):
        r = results[case]
        speedup = base / r["s_per_step"]
        print(f"{label:<34}{r['processes']:>10}{r['s_per_step']:>9.2f}{speedup:>10.2f}"
              f"{speedup / r['processes']:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
