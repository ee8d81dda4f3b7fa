"""Data-parallel and tensor-parallel scaling over processes pinned to one core each, same run.

The model: a plain Keras MLP 1024 -> 4096 -> 1024 (relu), global batch 512,
mean squared error, Adam; 8.4M parameters, 33.6 MB of gradients a step. Each
case is a fresh job (`tfdist.launch.local.run_local(..., pin_cores=True)`:
process i on core i, one TF thread pool each); its controller times `fit`
over the same global batches (per step, the median after 3 warm-up steps):

- one process (the baseline);
- MeshStrategy `data:2` over 2 worker processes (the mesh over workers:
  replicated gradients fused into buckets and all-reduced by TF's ring
  collectives between the processes);
- MeshStrategy `data:1;model:2` (the same MLP from ShardedDense, Megatron's
  column/row split of d_ff) over 2 processes;
- MultiWorkerStrategy (TF's MultiWorkerMirroredStrategy, RING) over 2 processes;
- HorovodStrategy over 2 ranks, each rank pinned to its core (needs Horovod).

Speed-up = baseline s/step / case s/step; efficiency = speed-up / processes.
The same run measures a raw loopback TCP transfer between two pinned
processes (the bandwidth ceiling) and, in the `data:2` job, the bytes/s of an
all-reduce of the model's 33.6 MB of gradients on the mesh's backend
(bytes / seconds, so a ring moving each byte once each way reaches the
ceiling). Last, in one (unpinned) process on 2 virtual CPU devices:
MeshStrategy("data:2") against tf.distribute.MirroredStrategy.

Each case runs `--rounds` times, interleaved; the table gives the median and
the spread (this machine's step times are bimodal from run to run).

    python bench/scaling.py [--steps 20] [--rounds 3] [--skip_horovod]
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

D_MODEL, D_FF, BATCH = 1024, 4096, 512
GRADIENT_BYTES = 4 * (2 * D_MODEL * D_FF + D_FF + D_MODEL)


def _data(steps):
    import numpy as np

    rng = np.random.default_rng(0)
    n = steps * BATCH
    return (rng.normal(size=(n, D_MODEL)).astype("float32"),
            rng.normal(size=(n, D_MODEL)).astype("float32"))


def _model(sharded: bool):
    import keras

    from tfdist.layers import ShardedDense

    keras.utils.set_random_seed(0)
    x = inputs = keras.Input((D_MODEL,))
    if sharded:
        h = ShardedDense(D_FF, ("d_model", "d_ff"), activation="relu", output_sharded=True)(x)
        y = ShardedDense(D_MODEL, ("d_ff", "d_model"), input_sharded=True)(h)
    else:
        h = keras.layers.Dense(D_FF, activation="relu")(x)
        y = keras.layers.Dense(D_MODEL)(h)
    return keras.Model(inputs, y)


def _time_fit(strategy, steps, sharded=False, warmup=3):
    """Median seconds per training step of `fit`, after `warmup` steps (tracing, iterator)."""
    import keras

    class StepTimes(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.seconds = []

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.seconds.append(time.perf_counter() - self.start)

    x, y = _data(steps + warmup)
    with strategy.scope():
        model = _model(sharded)
        model.compile(keras.optimizers.Adam(1e-4), "mse")
    timer = StepTimes()
    model.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False, callbacks=[timer])
    timed = sorted(timer.seconds[warmup:])
    return timed[len(timed) // 2]


def _all_reduce_bytes_per_s(strategy, repeats=5):
    """Bytes/s of a sum over all replicas of the model's gradients, on the mesh's backend."""
    import tensorflow as tf

    shapes = [(D_MODEL, D_FF), (D_FF,), (D_FF, D_MODEL), (D_MODEL,)]
    backend, everyone = strategy.backend, tuple(range(strategy.mesh.size))

    @tf.function
    def reduce(value):
        def replica_fn():
            # Inputs from an argument: Grappler would constant-fold an all-constant
            # Horovod all-reduce at trace time (it is not marked stateful).
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            tensors = [tf.fill(s, value + tf.cast(replica, tf.float32)) for s in shapes]
            index = strategy.mesh_device_index(int(tf.get_static_value(replica)))
            return tf.add_n([tf.reduce_sum(t) for t in backend.batch_all_reduce(
                tensors, index, everyone)])

        return strategy.run(replica_fn)

    best = float("inf")
    for k in range(repeats + 1):  # the first traces
        start = time.perf_counter()
        strategy.experimental_local_results(reduce(tf.constant(float(k))))[0].numpy()
        best = min(best, time.perf_counter() - start)
    return GRADIENT_BYTES / best


def job(args):
    """One case, in every process of a launched job; the controller writes the result."""
    result = {"case": args.case}
    if args.case == "horovod":
        os.sched_setaffinity(0, {int(os.environ.get("HOROVOD_RANK", "0")) % os.cpu_count()})
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        from tfdist.strategies import HorovodStrategy

        strategy = HorovodStrategy()
        result.update(processes=strategy.size, s_per_step=_time_fit(strategy, args.steps),
                      all_reduce_bytes_per_s=_all_reduce_bytes_per_s(strategy))
        chief = strategy.is_chief
    elif args.case == "multi_worker":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        from tfdist.callbacks import is_chief
        from tfdist.strategies import MultiWorkerStrategy

        strategy = MultiWorkerStrategy(communication="ring")
        result.update(processes=strategy.num_replicas_in_sync,
                      s_per_step=_time_fit(strategy, args.steps))
        chief = is_chief(strategy)
    else:
        from tfdist.cluster import ClusterConfig
        from tfdist.strategies import MeshStrategy

        devices = ClusterConfig.from_env().start(threads=1)  # serves and exits off-controller
        import tensorflow as tf

        if args.case == "one":
            strategy = tf.distribute.OneDeviceStrategy(devices[0])
        elif args.case == "mesh_dp":
            strategy = MeshStrategy(f"data:{len(devices)}", devices=devices)
        else:
            strategy = MeshStrategy(f"data:1;model:{len(devices)}", "d_ff:model", devices=devices)
        result.update(processes=len(devices),
                      s_per_step=_time_fit(strategy, args.steps, sharded=args.case == "mesh_tp"))
        if args.case == "mesh_dp":
            result["all_reduce_bytes_per_s"] = _all_reduce_bytes_per_s(strategy)
        chief = True
    if chief:
        with open(args.result, "w") as f:
            json.dump(result, f)


def in_process(steps):
    """MeshStrategy("data:2") vs MirroredStrategy on 2 virtual CPUs of this process."""
    from tfdist.devices import split_cpu

    split_cpu(2)
    import tensorflow as tf

    from tfdist.strategies import MeshStrategy

    cpus = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    times = {"mesh": [], "mirrored": []}
    for _ in range(2):  # interleaved, two rounds
        times["mesh"].append(_time_fit(MeshStrategy("data:2", devices=cpus), steps))
        times["mirrored"].append(_time_fit(tf.distribute.MirroredStrategy(cpus), steps))
    return {k: min(v) for k, v in times.items()}


def _duplex(conn, nbytes, buffer):
    """Sends and receives `nbytes` at once on `conn` (a thread sends, this one receives)."""
    import threading

    view = memoryview(buffer)
    sender = threading.Thread(target=conn.sendall, args=(view[:nbytes],))
    sender.start()
    got = 0
    while got < nbytes:
        got += conn.recv_into(view[nbytes + got:2 * nbytes], 2 * nbytes - got - nbytes)
    sender.join()


def _ring_pattern(conn, total, repeats):
    """A 2-process ring all-reduce's traffic: exchange total/2 bytes each way, twice."""
    buffer = bytearray(total)  # first half sent, second half received
    for _ in range(repeats):
        for _ in range(2):  # reduce-scatter, then all-gather
            _duplex(conn, total // 2, buffer)


def _peer(port, total, repeats, one_way):
    os.sched_setaffinity(0, {1 % os.cpu_count()})
    with socket.create_server(("127.0.0.1", port)) as server:
        conn, _ = server.accept()
        with conn:
            if one_way:
                got, buffer = 0, bytearray(1 << 20)
                while got < total * repeats:
                    got += conn.recv_into(buffer)
            else:
                _ring_pattern(conn, total, repeats)
            conn.sendall(b"k")


def loopback_bytes_per_s(total=GRADIENT_BYTES, repeats=8, one_way=False):
    """Raw TCP bytes/s between two processes pinned to cores 0 and 1.

    `one_way`: one stream from core 0 to core 1. Else the traffic of a
    2-process ring all-reduce of `total` bytes (each process sends and
    receives total/2 at once, twice), as bytes reduced per second: the
    ceiling of an all-reduce on this loopback, without its arithmetic.
    """
    import multiprocessing

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    peer = multiprocessing.get_context("fork").Process(
        target=_peer, args=(port, total, repeats, one_way))
    peer.start()
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        for _ in range(200):
            try:
                conn = socket.create_connection(("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                time.sleep(0.05)
        with conn:
            start = time.perf_counter()
            if one_way:
                payload = memoryview(bytearray(total))
                for _ in range(repeats):
                    conn.sendall(payload)
            else:
                _ring_pattern(conn, total, repeats)
            conn.recv(1)
            seconds = time.perf_counter() - start
    finally:
        os.sched_setaffinity(0, previous)
        peer.join(timeout=60)
    return total * repeats / seconds


def run_case(case, steps, processes):
    from tfdist.launch.local import run_local

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{case}.json")
        command = [sys.executable, os.path.abspath(__file__), f"--case={case}",
                   f"--steps={steps}", f"--result={path}"]
        if case == "horovod":
            runner = shutil.which("horovodrun", path=os.path.dirname(sys.executable))
            if runner is None:
                return None
            status = subprocess.call([runner, "-np", str(processes), "--gloo", "-H",
                                      f"localhost:{processes}", *command],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     timeout=600)
        else:
            status = run_local(command, processes, pin_cores=True, linger_s=2.0,
                               out=open(os.devnull, "w"))
        if status or not os.path.exists(path):
            print(f"{case}: the job failed (status {status})")
            return None
        return json.load(open(path))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="Fresh jobs per case (median).")
    parser.add_argument("--case", choices=["one", "mesh_dp", "mesh_tp", "multi_worker", "horovod"])
    parser.add_argument("--result")
    parser.add_argument("--skip_horovod", action="store_true")
    parser.add_argument("--skip_in_process", action="store_true")
    parser.add_argument("--in_process", action="store_true",
                        help="(internal) print the one-process comparison as JSON")
    args = parser.parse_args()
    if args.case:
        return job(args)
    if args.in_process:
        print(json.dumps(in_process(args.steps)))
        return 0
    print(f"MLP {D_MODEL}->{D_FF}->{D_MODEL}, batch {BATCH}, Adam, {args.steps} timed steps, "
          f"one core per process ({GRADIENT_BYTES / 1e6:.1f} MB of gradients a step)")
    one_way = max(loopback_bytes_per_s(one_way=True) for _ in range(3))
    raw = max(loopback_bytes_per_s() for _ in range(3))
    cases = [("one", 1, "one process"), ("mesh_dp", 2, "MeshStrategy data:2 (mesh over workers)"),
             ("mesh_tp", 2, "MeshStrategy data:1;model:2 (tensor parallel)"),
             ("multi_worker", 2, "MultiWorkerStrategy (RING)")]
    if not args.skip_horovod:
        cases.append(("horovod", 2, "HorovodStrategy (ranks pinned)"))
    # Rounds interleave the cases, so a slow spell of this shared machine hits them all.
    runs = {case: [] for case, _, _ in cases}
    for _ in range(args.rounds):
        for case, n, _ in cases:
            r = run_case(case, args.steps, n)
            if r is not None:
                runs[case].append(r)
    if not runs["one"]:
        return 1
    base = statistics.median_high([r["s_per_step"] for r in runs["one"]])
    print(f"{'case':<48}{'processes':>10}{'s/step':>9}{'(min-max)':>14}{'speed-up':>10}"
          f"{'efficiency':>12}")
    for case, n, label in cases:
        times = [r["s_per_step"] for r in runs[case]]
        if not times:
            print(f"{label:<48}{n:>10}{'failed':>9}")
            continue
        step = statistics.median_high(times)
        speedup = base / step
        spread = f"{min(times):.3f}-{max(times):.3f}"
        print(f"{label:<48}{n:>10}{step:>9.3f}{spread:>14}{speedup:>10.2f}"
              f"{speedup / n:>12.2f}   ({len(times)}/{args.rounds} runs)")
    print(f"raw loopback TCP, 2 pinned processes: {one_way / 1e9:.2f} GB/s one way; "
          f"{raw / 1e9:.2f} GB/s reduced by a ring all-reduce's traffic pattern (raw sockets)")
    if runs["mesh_dp"]:
        bw = statistics.median_high([r["all_reduce_bytes_per_s"] for r in runs["mesh_dp"]])
        print(f"all-reduce of {GRADIENT_BYTES / 1e6:.1f} MB on data:2 (TF ring collectives): "
              f"{bw / 1e9:.2f} GB/s = {bw / raw:.2f} of the raw ring pattern")
    if runs.get("horovod"):
        bw = statistics.median_high([r["all_reduce_bytes_per_s"] for r in runs["horovod"]])
        print(f"all-reduce of {GRADIENT_BYTES / 1e6:.1f} MB over 2 Horovod ranks (Gloo): "
              f"{bw / 1e9:.2f} GB/s = {bw / raw:.2f} of the raw ring pattern")
    if not args.skip_in_process:
        # In a fresh process: virtual devices must be set before TF starts.
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--in_process",
                              f"--steps={args.steps}"], capture_output=True, text=True)
        if out.returncode:
            print("in-process comparison failed:", out.stderr[-2000:])
        else:
            t = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"one process, 2 virtual CPUs: MeshStrategy data:2 {t['mesh']:.3f} s/step, "
                  f"MirroredStrategy {t['mirrored']:.3f} s/step: "
                  f"{t['mirrored'] / t['mesh']:.2f}x MirroredStrategy's speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
