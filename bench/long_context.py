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

Under a cap (`--cap_mib`): every device's process's address space (`RLIMIT_AS`)
at its baseline (after a step of 2048 tokens) plus the budget, the longest
sequence one device and the ring over 2 train a step of (target: >= 1.8x); the
controller runs in a process of its own, uncapped (it traces the graphs).

    python bench/long_context.py [--lengths 2048,4096,8192,16384] [--steps 3] [--repeats 3]
    python bench/long_context.py --cap_mib 512
"""

import argparse
import contextlib
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


def _model_and_data(case, strategy, length, steps):
    """`(model, x, y, rows)`: the model at `length` tokens compiled in `strategy`'s scope
    (None: one process) and `steps + 1` batches of one row, split for the mesh."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdist import sequence
    from tfdist.models.transformer import SequenceCrossentropy
    from tfdist.testing.causal_lm import CausalLM

    config = _config(length)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, config.vocab, size=(steps + 1, config.length + 1)).astype("int32")
    x, y = ids[:, :-1], ids[:, 1:]
    keras.utils.set_random_seed(0)
    if strategy is not None:
        # Each batch's tokens split for the mesh, as numpy (a dataset made on the
        # controller would be read on the controller's client device).
        split = sequence.split_sequences(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(1), strategy.mesh)
        x, y = (np.concatenate(t) for t in zip(*[(a.numpy(), b.numpy()) for a, b in split]))
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = CausalLM(config, method="ring" if case == "one" else case)
        model.compile(keras.optimizers.Adam(1e-4), SequenceCrossentropy(config.vocab))
    return model, x, y, len(x) // (steps + 1)


def job(args):
    """One case, run in every task of a launched job; the controller measures.

    With `--budget`: the job trains one step of a short sequence (every thread
    and pool started), every device's process caps its address space at its
    peak so far plus the budget (`tfdist.testing.memory_cap`; the controller,
    apart, is not capped: it holds the graphs, as a TPU host does), then the job
    trains one step at `--length`; a device out of memory fails the job."""
    from tfdist.testing import memory_cap

    task = json.loads(os.environ.get("TF_CONFIG", '{"task": {"index": 0}}'))["task"]["index"]
    if args.budget and task > 0:
        memory_cap.cap_when_told(args.signal_dir, task)
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
    import tensorflow as tf

    from bench.pipeline import timed_fit
    from tfdist.strategies import MeshStrategy

    if args.controller_apart:  # task 0 only drives the job
        devices = devices[1:]
    strategy = None
    if args.case != "one" or args.budget:  # capped: one device driven from the controller too
        strategy = (horovod if args.engine == "horovod" else
                    MeshStrategy(f"seq:{len(devices)}", "length:seq", devices=devices))
    if args.budget:  # the controller drives the step (its graph lives there), devices compute
        tiny, x, y, rows = _model_and_data(args.case, strategy, 4 * BLOCK, 1)
        tiny.fit(x, y, batch_size=rows, verbose=0)
        tasks = len(devices) + bool(args.controller_apart)
        caps = memory_cap.cap_job(args.signal_dir, tasks, args.budget,
                                  controller=not args.controller_apart)
        model, x, y, rows = _model_and_data(args.case, strategy, args.length, 0)
        loss = model.fit(x, y, batch_size=rows, verbose=0).history["loss"][0]
        from tfdist.testing.memory import job_status

        peaks = job_status("VmPeak")
        result = {"trained": True, "loss": loss, "caps": caps,
                  "peaks": [peaks[t] for t in sorted(peaks)]}
    else:
        model, x, y, rows = _model_and_data(args.case, strategy, args.length, args.steps)
        with tf.device(devices[0]):
            result = timed_fit(model, x, y, rows, args.steps)
    if args.engine == "horovod" and args.case != "one" and horovod.hvd.rank():
        return  # rank 0 reports every rank's process (same command line)
    with open(args.result, "w") as f:
        json.dump(result, f)


def _trains_under_cap(case, length, budget, tmp, timeout_s=900):
    """Whether `case` trains a step of `length` tokens with every process capped at its
    baseline plus `budget` bytes (a fresh job)."""
    from tfdist.launch.local import run_local

    path = os.path.join(tmp, f"capped-{case}-{length}.json")
    signals = tempfile.mkdtemp(dir=tmp)
    command = ["timeout", str(timeout_s), sys.executable, os.path.abspath(__file__),
               f"--case={case}", f"--length={length}", f"--result={path}",
               f"--budget={budget}", f"--signal_dir={signals}", "--controller_apart"]
    status = run_local(command, 2 if case == "one" else 3, pin_cores=True, linger_s=2.0,
                       out=open(os.devnull, "w"))
    return status == 0 and os.path.exists(path)


def _longest_under_cap(case, budget, tmp, start, step):
    """The longest multiple of `step` tokens `case` trains under the cap: doubling from
    `start` until a length fails, then bisecting."""
    def trains(length):
        ok = _trains_under_cap(case, length, budget, tmp)
        print(f"    {case} {length:>6} tokens: {'trains' if ok else 'fails'}", flush=True)
        return ok

    good, bad = 0, start
    while trains(bad):
        good, bad = bad, 2 * bad
    while bad - good > step:
        mid = (good + bad) // 2 // step * step
        if trains(mid):
            good = mid
        else:
            bad = mid
    return good


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
    parser.add_argument("--cap_mib", type=int, default=0,
                        help="with a budget (MiB above each process's baseline): the longest "
                             "sequence one process and the ring over 2 train under it")
    parser.add_argument("--case")
    parser.add_argument("--length", type=int)
    parser.add_argument("--result")
    parser.add_argument("--budget", type=int, default=0)
    parser.add_argument("--signal_dir")
    args = parser.parse_args()
    if args.case:
        return job(args)
    if args.cap_mib:
        return capped(args.cap_mib << 20)
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


def capped(budget):
    """The longest sequence one process and the ring over 2 processes train, every process's
    address space capped at its baseline plus `budget` (target: ring >= 1.8x one)."""
    print(f"Longest sequence under RLIMIT_AS = baseline + {budget >> 20} MiB per process "
          f"(the model above, one step; lengths in multiples of 1024):", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        one = _longest_under_cap("one", budget, tmp, 2048, 1024)
        ring = _longest_under_cap("ring", budget, tmp, max(one, 1024), 1024)
    print(f"  one process: {one} tokens; ring over 2: {ring} tokens ({ring / max(one, 1):.2f}x, "
          f"target 1.8x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
