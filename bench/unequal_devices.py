"""Unequal devices: batch shares proportional to speed against equal shares, one run.

Two Horovod ranks pinned one per core (`taskset -c RANK`); a busy process
(a Python spin loop) pinned to core 1 halves rank 1's speed. The model: 8 Dense
layers 256 wide (ReLU) and a 10-way softmax, Adam, global batch 8192 rows (so
the rows' compute, which the shares move, outweighs a step's fixed costs: the
gradient all-reduce, the optimizer, Keras's step; at 2048 rows those were about
half of a step), pure data parallelism under `HorovodStrategy(batch_shares=...)`:

- `equal`: every rank takes half of every batch (the slow rank sets the pace);
- `speed`: `SpeedProportionalBatches(every=10)` re-measures the ranks' speeds
  (a matmul probe on each rank) and moves rows to the faster one.

Both train the same global batches (equal to one process:
tests/cluster/test_horovod.py). Reports seconds per step over the last
`--steps` steps (after the shares settled), the speed-up of `speed` over
`equal` (target >= 1.3x; ideal 1.5x for a rank at half speed), and the shares.
Seconds per step are rank 0's wall time from the end of the 5th timed step to the
end of the last (a one-off stall of 1-2 s at the start of a `fit`, on either rank,
would otherwise swing a 40-step mean by 30 %), and each rank's CPU seconds per step
(under equal shares the fast rank idles: CPU below wall).

    python bench/unequal_devices.py [--steps 40] [--repeats 3]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BATCH, WIDTH, LAYERS = 8192, 256, 8


def job(args):
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist.callbacks import SpeedProportionalBatches
    from tfdist.strategies.horovod import HorovodStrategy

    strategy = HorovodStrategy(batch_shares="equal")
    warm = 30 if args.case == "speed" else 5
    rng = np.random.default_rng(0)
    rows = BATCH * (warm + args.steps)
    x = rng.normal(size=(rows, WIDTH)).astype("float32")
    y = rng.integers(0, 10, rows).astype("int32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((WIDTH,))] + [
            keras.layers.Dense(WIDTH, activation="relu") for _ in range(LAYERS)] + [
            keras.layers.Dense(10)])
        model.compile(keras.optimizers.Adam(1e-4),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    callbacks = []
    if args.case == "speed":
        speed = SpeedProportionalBatches(every=10, smoothing=0.3)
        callbacks.append(speed)
    head = slice(0, BATCH * warm)
    model.fit(x[head], y[head], batch_size=BATCH, shuffle=False, verbose=0, callbacks=callbacks)
    strategy.barrier("timed")
    ends = []

    class Window(keras.callbacks.Callback):  # from the end of step 5 to the end of the last
        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:
                ends.append((time.perf_counter(), time.process_time()))

        def on_train_end(self, logs=None):
            ends.append((time.perf_counter(), time.process_time()))

    tail = slice(BATCH * warm, None)
    model.fit(x[tail], y[tail], batch_size=BATCH, shuffle=False, verbose=0,
              callbacks=[Window()])
    (wall0, cpu0), (wall1, cpu1) = ends
    timed = args.steps - 5
    cpu = strategy.hvd.allgather(tf.constant([(cpu1 - cpu0) / timed], tf.float64),
                                 name="bench_cpu").numpy().tolist()
    if strategy.rank == 0:
        with open(args.result, "w") as f:
            json.dump({"s_per_step": (wall1 - wall0) / timed, "cpu_per_step": cpu,
                       "shares": list(strategy.batch_shares)}, f)


def _run(case, steps, tmp, busy=True):
    path = os.path.join(tmp, f"{case}.json")
    runner = shutil.which("horovodrun", path=os.path.dirname(sys.executable))
    pin = ["sh", "-c", 'exec taskset -c "$HOROVOD_RANK" "$0" "$@"']  # rank r on core r
    env = dict(os.environ, TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="2")
    busy = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"]
                            if busy else ["sleep", "1000000"])
    try:
        status = subprocess.call(
            [runner, "-np", "2", "--gloo", "-H", "localhost:2", *pin, sys.executable,
             os.path.abspath(__file__), f"--case={case}", f"--steps={steps}",
             f"--result={path}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=env)
    finally:
        busy.kill()
        busy.wait()
    if status or not os.path.exists(path):
        raise SystemExit(f"{case}: the job failed (status {status})")
    with open(path) as f:
        return json.load(f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--idle", action="store_true", help="also run both cases without "
                        "the spin loop (equal devices)")
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        return job(args)
    print(f"2 Horovod ranks pinned one per core, a spin loop sharing core 1; {LAYERS} Dense "
          f"layers {WIDTH} wide, batch {BATCH}, {args.steps} timed steps, median of "
          f"{args.repeats} jobs per case (alternating)")
    runs = {"equal": [], "speed": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for case in ("equal", "speed"):
                r = _run(case, args.steps, tmp)
                runs[case].append(r)
                print(f"  {case:<6} {r['s_per_step']:.4f} s/step (CPU s/step per rank "
                      f"{[round(c, 4) for c in r['cpu_per_step']]}), shares "
                      f"{[round(s, 3) for s in r['shares']]}", flush=True)
        if args.idle:
            for case in ("equal", "speed"):
                r = _run(case, args.steps, tmp, busy=False)
                print(f"  {case:<6} without the spin loop: {r['s_per_step']:.4f} s/step (CPU "
                      f"{[round(c, 4) for c in r['cpu_per_step']]}), shares "
                      f"{[round(s, 3) for s in r['shares']]}", flush=True)
    med = {c: sorted(r["s_per_step"] for r in rs)[len(rs) // 2] for c, rs in runs.items()}
    print(f"equal shares {med['equal']:.4f} s/step, speed-proportional {med['speed']:.4f} "
          f"s/step: {med['equal'] / med['speed']:.2f}x (target >= 1.3x, ideal 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
