"""Pipeline parallelism over processes pinned one per core, against one process, same run.

The model: 16 Dense layers 1024 wide (ReLU) and a linear head, MSE, Adam,
global batch 512. Every case is a fresh job started with tfdist.launch, each
process pinned to its own core with one TF thread:

- `keras`: the plain Keras model in one process (the baseline of the speed-up);
- `one m=M`: the same layers as a 1-stage `Pipeline` with M micro-batches in one
  process (the same micro-batch sizes as the pipelined runs: the ideal time of
  2 stages is half of it, so the measured bubble is 1 - (one / 2) / two);
- `1f1b m=M`, `gpipe m=M`: 2 stages of 8 layers, stage s on process s.

The table reports seconds per step, the speed-up over `keras`, the measured
bubble against GPipe's analytic (p-1)/(m+p-1), and for each stage the rise of
the peak RSS during the timed steps over the RSS before them (activations and
gradients; the weights and Adam slots were there before), with 1F1B's over
GPipe's against the target (p-s)/m.

    python bench/pipeline.py [--steps 6] [--microbatches 2,4,8,16]
"""

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WIDTH, LAYERS, BATCH = 1024, 16, 512


def _layers(first, count, head):
    import keras

    layers = [keras.layers.Dense(WIDTH, activation="relu", name=f"dense_{first + i}")
              for i in range(count)]
    return layers + ([keras.layers.Dense(WIDTH, name="head")] if head else [])


def _job_pids():
    me = open(f"/proc/{os.getpid()}/cmdline", "rb").read()
    return [pid for pid in filter(str.isdigit, os.listdir("/proc"))
            if _read(f"/proc/{pid}/cmdline") == me]


def _read(path):
    try:
        return open(path, "rb").read()
    except OSError:
        return b""


def _reset_peaks():
    """Every task's peak RSS back to its RSS (the controller resets the workers')."""
    for pid in _job_pids():
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")


def job(args):
    """One case, run in every task of a launched job; the controller measures."""
    import time

    from tfdist.cluster import ClusterConfig

    devices = ClusterConfig.from_env().start(threads=1)
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist.pipeline.model import Pipeline
    from tfdist.testing.memory import job_status

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=((args.steps + 1) * BATCH, WIDTH)).astype("float32")
    y = rng.normal(size=((args.steps + 1) * BATCH, WIDTH)).astype("float32")
    if args.case == "keras":
        with tf.device(devices[0]):
            model = keras.Sequential([keras.Input((WIDTH,))] + _layers(0, LAYERS, True))
    else:
        stages = len(devices)
        per = LAYERS // stages
        model = Pipeline([keras.Sequential(_layers(s * per, per, s == stages - 1))
                          for s in range(stages)], devices=devices,
                         schedule="1f1b" if args.case == "one" else args.case,
                         num_microbatches=args.microbatches, input_shape=(WIDTH,))
    model.compile(keras.optimizers.Adam(1e-4), "mse")
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)  # trace, warm up
    before = job_status("VmRSS")
    _reset_peaks()
    start = time.perf_counter()
    model.fit(x[BATCH:], y[BATCH:], batch_size=BATCH, verbose=0, shuffle=False)
    seconds = (time.perf_counter() - start) / args.steps
    peaks = job_status("VmHWM")
    rise = [peaks[t] - before[t] for t in sorted(before)]
    with open(args.result, "w") as f:
        json.dump({"s_per_step": seconds, "rss_rise": rise}, f)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--microbatches", default="2,4,8,16")
    parser.add_argument("--case")
    parser.add_argument("--result")
    parser.add_argument("--num_microbatches", dest="microbatches_one", type=int)
    args = parser.parse_args()
    if args.case:
        args.microbatches = args.microbatches_one
        return job(args)
    from tfdist.launch.local import run_local
    from tfdist.testing.memory import RSS_FOLLOWS_TENSORS

    # Every case (the baseline too) without TF's pooling CPU allocator, so that a
    # process's RSS follows its live tensors.
    os.environ.update(RSS_FOLLOWS_TENSORS)
    ms = [int(m) for m in args.microbatches.split(",")]
    print(f"Pipeline over processes: {LAYERS} Dense layers {WIDTH} wide, batch {BATCH}, Adam, "
          f"{args.steps} timed steps, one core and one thread per process")
    cases = [("keras", 1, 1)] + [(c, m, n) for m in ms
                                 for c, n in (("one", 1), ("gpipe", 2), ("1f1b", 2))]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case, m, n in cases:
            path = os.path.join(tmp, f"{case}-{m}.json")
            command = [sys.executable, os.path.abspath(__file__), f"--case={case}",
                       f"--num_microbatches={m}", f"--steps={args.steps}", f"--result={path}"]
            status = run_local(command, n, pin_cores=True, linger_s=2.0,
                               out=open(os.devnull, "w"))
            if status or not os.path.exists(path):
                print(f"{case} m={m}: the job failed (status {status})")
                return 1
            results[case, m] = json.load(open(path))
    base = results["keras", 1]["s_per_step"]
    print(f"{'case':<12}{'processes':>10}{'s/step':>9}{'speed-up':>10}{'bubble':>9}"
          f"{'analytic':>10}{'RSS rise per stage (MiB)':>27}{'1F1B/GPipe':>13}{'target':>14}")
    print(f"{'keras':<12}{1:>10}{base:>9.3f}{1.0:>10.2f}")
    for m in ms:
        one = results["one", m]["s_per_step"]
        print(f"{'one m=' + str(m):<12}{1:>10}{one:>9.3f}{base / one:>10.2f}")
        for case in ("gpipe", "1f1b"):
            r = results[case, m]
            bubble = 1 - (one / 2) / r["s_per_step"]
            rise = [b / 2 ** 20 for b in r["rss_rise"]]
            line = (f"{case + ' m=' + str(m):<12}{2:>10}{r['s_per_step']:>9.3f}"
                    f"{base / r['s_per_step']:>10.2f}{bubble:>9.2f}{1 / (m + 1):>10.2f}"
                    f"{' '.join(f'{v:8.1f}' for v in rise):>27}")
            if case == "1f1b":
                gpipe = results["gpipe", m]["rss_rise"]
                ratio = [a / max(b, 1) for a, b in zip(r["rss_rise"], gpipe)]
                target = [min(2 - s, m) / m for s in range(2)]
                line += (f"{' '.join(f'{v:.2f}' for v in ratio):>13}"
                         f"{' '.join(f'{v:.2f}' for v in target):>14}")
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
