"""Pipeline parallelism over processes pinned one per core, against one process, same run.

The model: 16 Dense layers 1024 wide (ReLU, the last linear), MSE, Adam,
global batch 2048 (8 layers per stage: balanced). Every case is a fresh job started with tfdist.launch, each
process pinned to its own core with one TF thread:

- `keras`: the plain Keras model in one process (the baseline of the speed-up);
- `one m=M`: the same layers as a 1-stage `Pipeline` with M micro-batches in one
  process (the same micro-batch sizes as the pipelined runs: the ideal time of
  2 stages is half of it, so the measured bubble is 1 - (one / 2) / two);
- `1f1b m=M`, `gpipe m=M`: 2 stages of 8 layers, stage s on process s;
- `inter. m=M`: interleaved 1F1B, 4 virtual stages of 4 layers, virtual stage
  k on process k % 2 (half the bubble, twice the transfers).

The table reports seconds per step, the speed-up over `keras`, the measured
bubble against the analytic (p-1)/(m+p-1), and the CPU seconds per step of
each process. Then, in runs with TF's pooling allocator off (RSS follows the
live tensors) and a larger batch, each stage's rise of the peak RSS during a
step over the RSS before it (activations and gradients; the weights and Adam
slots were there before), 1F1B's over GPipe's against min(p-s, m)/m.

    python bench/pipeline.py [--steps 6] [--repeats 3] [--microbatches 2,4,8,16]
                             [--memory_batch 8192]
"""

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

WIDTH, LAYERS, BATCH = 1024, 16, 2048


def _layers(first, count):
    """Layers first..first+count-1 of the 16: ReLU, the last one linear."""
    import keras

    return [keras.layers.Dense(WIDTH, activation=None if j == LAYERS - 1 else "relu",
                               name=f"dense_{j}") for j in range(first, first + count)]


def _job_pids():
    me = open(f"/proc/{os.getpid()}/cmdline", "rb").read()
    return [pid for pid in filter(str.isdigit, os.listdir("/proc"))
            if _read(f"/proc/{pid}/cmdline") == me]


def _read(path):
    try:
        return open(path, "rb").read()
    except OSError:
        return b""


def _cpu_seconds():
    """CPU seconds (user + system) of each task of the job, by pid."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for pid in _job_pids():
        fields = _read(f"/proc/{pid}/stat").rsplit(b")", 1)[-1].split()
        if fields:
            found[int(pid)] = (int(fields[11]) + int(fields[12])) / ticks
    return found


def _reset_peaks():
    """Every task's peak RSS back to its RSS (the controller resets the workers')."""
    for pid in _job_pids():
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")


def job(args):
    """One case, run in every task of a launched job; the controller measures."""

    from tfdist.cluster import ClusterConfig

    # One intra-op thread per process (its core), two inter-op threads: with one,
    # TF's executor runs a stage's micro-batches inline before sending their
    # outputs (ClusterConfig.start).
    devices = ClusterConfig.from_env().start(threads=1, inter_op_threads=2)
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist.pipeline.model import Pipeline

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    batch = args.batch
    x = rng.normal(size=((args.steps + 1) * batch, WIDTH)).astype("float32")
    y = rng.normal(size=((args.steps + 1) * batch, WIDTH)).astype("float32")
    if args.case == "keras":
        with tf.device(devices[0]):
            model = keras.Sequential([keras.Input((WIDTH,))] + _layers(0, LAYERS))
    else:
        if args.controller_apart:  # task 0 only drives the job: the stages on tasks 1..p
            devices = devices[1:]
        chunks = 2 if args.case == "interleaved_1f1b" else 1  # virtual stages per device
        stages = len(devices) * chunks
        per = LAYERS // stages
        model = Pipeline([keras.Sequential(_layers(s * per, per))
                          for s in range(stages)], devices=devices,
                         schedule="1f1b" if args.case == "one" else args.case,
                         num_microbatches=args.microbatches, num_chunks=chunks,
                         input_shape=(WIDTH,))
    model.compile(keras.optimizers.Adam(1e-4), "mse")
    # Ops with no device of their own (Keras's step around the model: the
    # batch's split, the loss, the metrics) on the first device, not on the
    # controller's client device (job "localhost": a copy of every weight read
    # there for the Keras model).
    with tf.device(devices[0]):
        result = timed_fit(model, x, y, batch, args.steps)
    with open(args.result, "w") as f:
        json.dump(result, f)


def timed_fit(model, x, y, batch, steps):
    """One warm-up `fit` step on `x[:batch]`, then `steps` timed ones; seconds per step, the CPU
    seconds per step of every task of the job and each task's peak RSS rise during them."""
    import time

    from tfdist.testing.memory import job_status

    model.fit(x[:batch], y[:batch], batch_size=batch, verbose=0)  # trace, warm up
    before = job_status("VmRSS")
    _reset_peaks()
    cpu = _cpu_seconds()
    start = time.perf_counter()
    model.fit(x[batch:], y[batch:], batch_size=batch, verbose=0, shuffle=False)
    seconds = (time.perf_counter() - start) / steps
    cpu = [(t - cpu.get(pid, 0.0)) / steps for pid, t in sorted(_cpu_seconds().items())]
    peaks = job_status("VmHWM")
    rise = [peaks[t] - before[t] for t in sorted(before)]
    return {"s_per_step": seconds, "rss_rise": rise, "cpu_s_per_step": cpu}


def _median_run(repeats, *args, **kwargs):
    """The run of median seconds per step among `repeats` fresh jobs."""
    runs = sorted((_run(*args, **kwargs) for _ in range(repeats)), key=lambda r: r["s_per_step"])
    return runs[len(runs) // 2]


def _run(case, m, processes, steps, batch, tmp, controller_apart=False):
    from tfdist.launch.local import run_local

    path = os.path.join(tmp, f"{case}-{m}-{batch}.json")
    command = [sys.executable, os.path.abspath(__file__), f"--case={case}",
               f"--num_microbatches={m}", f"--steps={steps}", f"--batch={batch}",
               f"--result={path}"] + (["--controller_apart"] if controller_apart else [])
    status = run_local(command, processes, pin_cores=True, linger_s=2.0,
                       out=open(os.devnull, "w"))
    if status or not os.path.exists(path):
        raise SystemExit(f"{case} m={m}: the job failed (status {status})")
    return json.load(open(path))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="jobs per case; the median")
    parser.add_argument("--microbatches", default="2,4,8,16")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--memory_batch", type=int, default=8192)
    parser.add_argument("--memory_microbatches", type=int, default=8)
    parser.add_argument("--controller_apart", action="store_true")
    parser.add_argument("--case")
    parser.add_argument("--result")
    parser.add_argument("--num_microbatches", dest="microbatches_one", type=int)
    args = parser.parse_args()
    if args.case:
        args.microbatches = args.microbatches_one
        return job(args)
    from tfdist.pipeline.schedule import analytic_bubble
    from tfdist.testing.memory import RSS_FOLLOWS_TENSORS

    ms = [int(m) for m in args.microbatches.split(",")]
    print(f"Pipeline over processes: {LAYERS} Dense layers {WIDTH} wide, batch {args.batch}, "
          f"Adam, {args.steps} timed steps, median of {args.repeats} jobs per case; one core, "
          f"one intra-op thread per process")
    with tempfile.TemporaryDirectory() as tmp:
        base = _median_run(args.repeats, "keras", 1, 1, args.steps, args.batch, tmp)["s_per_step"]
        print(f"{'case':<12}{'processes':>10}{'s/step':>9}{'speed-up':>10}{'bubble':>9}"
              f"{'analytic':>10}{'CPU s/step per process':>26}")
        print(f"{'keras':<12}{1:>10}{base:>9.3f}{1.0:>10.2f}", flush=True)
        for m in ms:
            one = _median_run(args.repeats, "one", m, 1, args.steps, args.batch, tmp)["s_per_step"]
            print(f"{'one m=' + str(m):<12}{1:>10}{one:>9.3f}{base / one:>10.2f}", flush=True)
            for case in ("gpipe", "1f1b", "interleaved_1f1b"):
                r = _median_run(args.repeats, case, m, 2, args.steps, args.batch, tmp)
                bubble = 1 - (one / 2) / r["s_per_step"]
                name = {"interleaved_1f1b": "inter."}.get(case, case) + f" m={m}"
                chunks = 2 if case == "interleaved_1f1b" else 1
                print(f"{name:<12}{2:>10}{r['s_per_step']:>9.3f}"
                      f"{base / r['s_per_step']:>10.2f}{bubble:>9.2f}"
                      f"{analytic_bubble(case, 2, m, chunks):>10.2f}"
                      f"{' '.join(f'{c:8.2f}' for c in r['cpu_s_per_step']):>26}", flush=True)

        # Memory: TF's pooling allocator off (RSS follows the live tensors; slower,
        # so apart from the timings), a batch whose activations outweigh the
        # stage's gradients, 2 steps, and the controller (Keras's loop, the data)
        # in a third process, so that each stage's process holds only its own.
        os.environ.update(RSS_FOLLOWS_TENSORS)
        m, batch = args.memory_microbatches, args.memory_batch
        rises = {case: _run(case, m, 3, 2, batch, tmp, controller_apart=True)["rss_rise"][1:]
                 for case in ("gpipe", "1f1b")}
        print(f"\nPeak RSS rise per stage during a step (activations, gradients), batch {batch}, "
              f"m={m}:")
        kept = batch // m * WIDTH * 4 * (LAYERS // 2)  # one micro-batch's layer inputs
        for s in range(2):
            gpipe, one_f = rises["gpipe"][s], rises["1f1b"][s]
            stash = min(2 - s, m)
            # If stage s keeps m micro-batches under GPipe and `stash` under 1F1B,
            # the difference is (m - stash) micro-batches' activations: compare it
            # with what one micro-batch's layer inputs weigh.
            a = (gpipe - one_f) / (m - stash)
            print(f"  stage {s}: GPipe {gpipe / 2 ** 20:7.1f} MiB, 1F1B {one_f / 2 ** 20:7.1f} "
                  f"MiB: 1F1B/GPipe {one_f / max(gpipe, 1):.2f} (activations' target: "
                  f"{stash}/{m} + 0.10 = {stash / m + 0.1:.2f}); (GPipe - 1F1B) / (m - {stash}) "
                  f"= {a / 2 ** 20:.1f} MiB per micro-batch, its layer inputs "
                  f"{kept / 2 ** 20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
