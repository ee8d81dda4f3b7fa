"""Peak host memory of checkpoint save and load on a mesh over 4 worker processes.

A stack of ShardedDense pairs (d_model 512, d_ff 8192, d_ff on `model`) on a
`data:1;model:4` mesh over 4 worker processes (one device each): the model's
global weights + Adam slots are 4x each process's shards. After one training
step (slots exist), each process's peak RSS above its own RSS just before
the operation (`VmHWM` reset through `/proc/<pid>/clear_refs`) is measured
during: a sharded save (`tfdist.checkpoint.save(model, "x.shards")`), a
sharded load, and the global `.npz` save (every shard gathered to the
controller, which writes) for comparison. Workers run with TF's allocator
and glibc returning freed memory (`tfdist.testing.memory.RSS_FOLLOWS_TENSORS`),
so RSS follows live tensors. Target: sharded save and load peak <= 1.5x the
process's own shard bytes.

    python bench/checkpoint_memory.py [--layers 3]
"""

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

D_MODEL, D_FF, WORKERS = 512, 8192, 4


def _status_mib(pid, field):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _reset(pids):
    base = {}
    for task, pid in pids.items():
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        base[task] = _status_mib(pid, "VmRSS")
    return base


def _peaks(pids, base):
    return {task: _status_mib(pid, "VmHWM") - base[task] for task, pid in pids.items()}


def job(args):
    """Every task: record its pid, serve; the controller builds, trains, saves, loads, measures."""
    from tfdist.cluster import ClusterConfig

    cluster = ClusterConfig.from_env()
    with open(os.path.join(args.dir, f"pid-{cluster.task_index}"), "w") as f:
        f.write(str(os.getpid()))
    devices = cluster.start(devices_per_worker=1)
    import time

    import keras
    import numpy as np

    from tfdist import checkpoint
    from tfdist.layers import ShardedDense
    from tfdist.strategies import MeshStrategy
    from tfdist.testing.memory import device_bytes

    strategy = MeshStrategy(f"data:1;model:{len(devices)}", "d_ff:model", devices=devices)
    with strategy.scope():
        inputs = keras.Input((D_MODEL,))
        h = inputs
        for k in range(args.layers):
            f = ShardedDense(D_FF, ("d_model", "d_ff"), activation="relu", output_sharded=True,
                             use_bias=False, name=f"in_{k}")(h)
            h = h + ShardedDense(D_MODEL, ("d_ff", "d_model"), input_sharded=True,
                                 use_bias=False, name=f"out_{k}")(f)
        model = keras.Model(inputs, h)
        model.compile(keras.optimizers.Adam(1e-3), "mse")
    x = np.random.default_rng(0).normal(size=(8, D_MODEL)).astype("float32")
    model.fit(x, x, batch_size=8, verbose=0)
    shard = device_bytes(model, 0) / 2**20
    total = 4 * sum(v.shape.num_elements() for v in model.weights) / 2**20 * 3  # + 2 slots
    time.sleep(1.0)
    pids = {int(n.split("-")[1]): int(open(os.path.join(args.dir, n)).read())
            for n in os.listdir(args.dir) if n.startswith("pid-")}
    results = {"shard_mib": shard, "global_mib": total}
    sharded = os.path.join(args.dir, "model.shards")
    for name, action in (("sharded save", lambda: checkpoint.save(model, sharded)),
                         ("sharded load", lambda: checkpoint.load(model, sharded)),
                         ("npz save", lambda: checkpoint.save(
                             model, os.path.join(args.dir, "model.npz")))):
        base = _reset(pids)
        start = time.perf_counter()
        action()
        seconds = time.perf_counter() - start
        time.sleep(0.5)
        results[name] = {"peaks": _peaks(pids, base), "seconds": seconds}
    with open(args.result, "w") as f:
        json.dump(results, f)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--job", action="store_true")
    parser.add_argument("--dir")
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.job:
        return job(args)
    from tfdist.launch.local import run_local
    from tfdist.testing.memory import RSS_FOLLOWS_TENSORS

    os.environ.update(RSS_FOLLOWS_TENSORS)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        command = [sys.executable, os.path.abspath(__file__), "--job", f"--layers={args.layers}",
                   f"--dir={tmp}", f"--result={result}"]
        status = run_local(command, WORKERS, linger_s=2.0, out=open(os.devnull, "w"))
        if status or not os.path.exists(result):
            print(f"the job failed (status {status})")
            return 1
        r = json.load(open(result))
    shard = r["shard_mib"]
    print(f"Checkpoint peak host memory, mesh data:1;model:{WORKERS} over {WORKERS} worker "
          f"processes: weights + Adam slots {r['global_mib']:.0f} MiB global, {shard:.0f} MiB "
          f"per process (task 0 is the controller)")
    print(f"{'operation':<14}{'seconds':>9}" + "".join(f"{'task ' + str(t):>10}"
                                                     for t in range(WORKERS)) + f"{'worst/shard':>13}")
    for name in ("sharded save", "sharded load", "npz save"):
        peaks = {int(t): p for t, p in r[name]["peaks"].items()}
        worst = max(peaks.values())
        print(f"{name:<14}{r[name]['seconds']:>9.2f}" + "".join(
            f"{peaks[t]:>10.0f}" for t in range(WORKERS)) + f"{worst / shard:>12.2f}x")
    print("MiB above each process's RSS before the operation; target sharded <= 1.5x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
