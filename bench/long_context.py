"""Sequence parallelism over processes pinned one per core, against one process, same run.

The model: `tfdist.testing.causal_lm.CausalLM`, 2 pre-norm decoder blocks
(d_model 256, 4 heads of 64, d_ff 1024, vocabulary 256), causal attention in
blocks of 512 tokens on both sides (`attention_block`: the one-process
baseline runs the same blockwise kernel, skipping the same masked blocks, so
both sides do the same work), batch 1, Adam, lengths 2048-16384. Every case
is a fresh job started with tfdist.launch, each process pinned to its own core
with one TF thread:

- `one`: the model in one process (no mesh);
- `ring`, `ulysses`: `length:seq` over a mesh of the two processes
  (`seq:2`), batches split by `tfdist.sequence.split_sequences` (zig-zag).

The table reports seconds per step, the speed-up over `one`, and the CPU
seconds per step of each process. Then, with TF's pooling allocator off (RSS
follows the live tensors) and the controller in a third process, the rise of
each device's peak RSS during a step over its RSS before it, against one
process's (target 1/2 + 10%).

    python bench/long_context.py [--lengths 2048,4096,8192,16384] [--steps 3] [--repeats 3]
"""

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BLOCK = 512


def _config(length):
    from tfdist.testing.causal_lm import LMConfig

    return LMConfig(vocab=256, length=length, d_model=256, heads=4, d_kv=64, layers=2,
                    d_ff=1024, attention_block=BLOCK)


def job(args):
    """One case, run in every task of a launched job; the controller measures."""
    if args.engine == "horovod" and args.case != "one":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(2)
        from tfdist.strategies.horovod import HorovodStrategy

        horovod = HorovodStrategy(mesh_shape="seq:2", layout="length:seq")
        devices = list(horovod.extended.worker_devices)
    else:
        from tfdist.cluster import ClusterConfig

        devices = ClusterConfig.from_env().start(threads=1, inter_op_threads=2)
    import keras
    import numpy as np
    import tensorflow as tf

    from bench.pipeline import timed_fit
    from tfdist import sequence
    from tfdist.models.transformer import SequenceCrossentropy
    from tfdist.strategies import MeshStrategy
    from tfdist.testing.causal_lm import CausalLM

    config = _config(args.length)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, config.vocab, size=(args.steps + 1, config.length + 1)).astype("int32")
    x, y = ids[:, :-1], ids[:, 1:]
    keras.utils.set_random_seed(0)
    if args.controller_apart:  # task 0 only drives the job
        devices = devices[1:]
    if args.case == "one":
        strategy, scope = None, tf.device(devices[0])
    else:
        strategy = (horovod if args.engine == "horovod" else
                    MeshStrategy(f"seq:{len(devices)}", "length:seq", devices=devices))
        scope = strategy.scope()
        # Each batch's tokens split for the mesh, as numpy (a dataset made on the
        # controller would be read on the controller's client device).
        split = sequence.split_sequences(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(1), strategy.mesh)
        x, y = (np.concatenate(t) for t in zip(*[(a.numpy(), b.numpy()) for a, b in split]))
    rows = len(x) // (args.steps + 1)  # one global batch
    with scope:
        model = CausalLM(config, method=args.case if strategy else "ring")
        model.compile(keras.optimizers.Adam(1e-4), SequenceCrossentropy(config.vocab))
    with tf.device(devices[0]):
        result = timed_fit(model, x, y, rows, args.steps)
    if args.engine == "horovod" and args.case != "one" and horovod.hvd.rank():
        return  # rank 0 reports every rank's process (same command line)
    with open(args.result, "w") as f:
        json.dump(result, f)


def _run(case, length, processes, steps, tmp, controller_apart=False, engine="mesh"):
    import shutil
    import subprocess

    from tfdist.launch.local import run_local

    path = os.path.join(tmp, f"{case}-{length}.json")
    command = [sys.executable, os.path.abspath(__file__), f"--case={case}",
               f"--length={length}", f"--steps={steps}", f"--result={path}",
               f"--engine={engine}"] + (["--controller_apart"] if controller_apart else [])
    if engine == "horovod" and case != "one":
        runner = shutil.which("horovodrun", path=os.path.dirname(sys.executable))
        pin = ["sh", "-c", 'exec taskset -c "$HOROVOD_RANK" "$0" "$@"']  # rank r on core r
        status = subprocess.call([runner, "-np", str(processes), "--gloo", "-H",
                                  f"localhost:{processes}", *pin, *command],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    else:
        status = run_local(command, processes, pin_cores=True, linger_s=2.0,
                           out=open(os.devnull, "w"))
    if status or not os.path.exists(path):
        raise SystemExit(f"{case} length {length}: the job failed (status {status})")
    return json.load(open(path))


def _median_run(repeats, *args, **kwargs):
    runs = sorted((_run(*args, **kwargs) for _ in range(repeats)), key=lambda r: r["s_per_step"])
    return runs[len(runs) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="2048,4096,8192,16384")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="jobs per case; the median")
    parser.add_argument("--methods", default="ring,ulysses")
    parser.add_argument("--memory_length", type=int, default=8192)
    parser.add_argument("--controller_apart", action="store_true")
    parser.add_argument("--engine", default="mesh", choices=["mesh", "horovod"],
                        help="the 2-process runs: a mesh over TF_CONFIG workers (gRPC, one "
                             "controller) or HorovodStrategy ranks (Gloo)")
    parser.add_argument("--case")
    parser.add_argument("--length", type=int)
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.case:
        return job(args)
    from tfdist.testing.memory import RSS_FOLLOWS_TENSORS

    lengths = [int(n) for n in args.lengths.split(",")]
    methods = args.methods.split(",")
    print(f"Sequence parallelism over processes: 2 decoder blocks, d_model 256, 4 heads of 64, "
          f"d_ff 1024, attention blocks of {BLOCK}, batch 1, Adam, {args.steps} timed steps, "
          f"median of {args.repeats} jobs per case; one core, one intra-op thread per process")
    print(f"{'length':>7}{'case':>9}{'processes':>10}{'s/step':>9}{'speed-up':>10}"
          f"{'CPU s/step per process':>26}")
    with tempfile.TemporaryDirectory() as tmp:
        for length in lengths:
            one = _median_run(args.repeats, "one", length, 1, args.steps, tmp)
            print(f"{length:>7}{'one':>9}{1:>10}{one['s_per_step']:>9.3f}{1.0:>10.2f}"
                  f"{' '.join(f'{c:8.2f}' for c in one['cpu_s_per_step']):>26}", flush=True)
            for method in methods:
                r = _median_run(args.repeats, method, length, 2, args.steps, tmp,
                                engine=args.engine)
                print(f"{length:>7}{method:>9}{2:>10}{r['s_per_step']:>9.3f}"
                      f"{one['s_per_step'] / r['s_per_step']:>10.2f}"
                      f"{' '.join(f'{c:8.2f}' for c in r['cpu_s_per_step']):>26}", flush=True)

        # Memory: the pooling allocator off, the controller in a process of its own.
        os.environ.update(RSS_FOLLOWS_TENSORS)
        length = args.memory_length
        one = _run("one", length, 2, 2, tmp, controller_apart=True)["rss_rise"][1:]
        print(f"\nPeak RSS rise per device during a step, length {length}:")
        print(f"  one process: {one[0] / 2 ** 20:7.1f} MiB")
        for method in methods:
            rise = _run(method, length, 3, 2, tmp, controller_apart=True)["rss_rise"][1:]
            print(f"  {method} over 2: " + ", ".join(
                f"{r / 2 ** 20:7.1f} MiB ({r / max(one[0], 1):.2f} of one)" for r in rise)
                + " (target 0.50 + 0.10)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
