"""HorovodStrategy vs tf.distribute MultiWorkerMirroredStrategy (RING), 2 processes, same run.

Needs Horovod (make horovod). The same MLP (4 x Dense(1024), ~4.2M parameters, 17 MB of gradients per step),
the same global batches, Adam, 2 processes on loopback for both engines;
steps/s and the ratio, then Horovod again with other HOROVOD_CYCLE_TIME and
HOROVOD_FUSION_THRESHOLD settings.

    python bench/horovod_vs_multi_worker.py [--steps 30]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BATCH, WIDTH = 64, 1024


def job(args):
    import time

    import keras
    import numpy as np

    if args.engine == "horovod":
        from tfdist.strategies.horovod import HorovodStrategy

        strategy = HorovodStrategy()
        chief = strategy.rank == 0
    else:
        from tfdist.callbacks import is_chief
        from tfdist.strategies import MultiWorkerStrategy

        strategy = MultiWorkerStrategy(communication="ring")
        chief = is_chief(strategy)
    rng = np.random.default_rng(0)
    n = (args.steps + 5) * BATCH
    x = rng.normal(size=(n, WIDTH)).astype("float32")
    y = rng.normal(size=(n, WIDTH)).astype("float32")
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((WIDTH,))] +
                                 [keras.layers.Dense(WIDTH, activation="tanh") for _ in range(4)])
        model.compile(keras.optimizers.Adam(1e-4), "mse")
    model.fit(x[:5 * BATCH], y[:5 * BATCH], batch_size=BATCH, verbose=0)  # warm up
    start = time.perf_counter()
    model.fit(x[5 * BATCH:], y[5 * BATCH:], batch_size=BATCH, verbose=0, shuffle=False)
    speed = args.steps / (time.perf_counter() - start)
    if chief:
        with open(args.result, "w") as f:
            json.dump({"steps_per_s": speed}, f)


def run(engine, steps, env=None):
    from tfdist.launch.local import run_local

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "r.json")
        command = [sys.executable, os.path.abspath(__file__), f"--engine={engine}",
                   f"--steps={steps}", f"--result={path}"]
        environ = dict(os.environ, **(env or {}))
        if engine == "horovod":
            runner = shutil.which("horovodrun", path=os.path.dirname(sys.executable))
            status = subprocess.call([runner, "-np", "2", "--gloo", "-H", "localhost:2", *command],
                                     env=environ, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        else:
            old = dict(os.environ)
            os.environ.update(env or {})
            status = run_local(command, 2, out=open(os.devnull, "w"))
            os.environ.clear()
            os.environ.update(old)
        if status or not os.path.exists(path):
            raise SystemExit(f"{engine} {env or ''}: the job failed (status {status})")
        return json.load(open(path))["steps_per_s"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--engine", choices=["horovod", "multi_worker"])
    parser.add_argument("--result")
    args = parser.parse_args()
    if args.engine:
        return job(args)
    print(f"2 processes, MLP 4 x Dense({WIDTH}), batch {BATCH}, Adam, {args.steps} timed steps")
    mwms = run("multi_worker", args.steps)
    print(f"{'engine':<52}{'steps/s':>9}{'vs MWMS':>9}")
    print(f"{'MultiWorkerMirroredStrategy (RING)':<52}{mwms:>9.2f}{1:>9.2f}")
    for label, env in (("HorovodStrategy (defaults: cycle 1 ms, fusion 128 MB)", {}),
                       ("HorovodStrategy, HOROVOD_CYCLE_TIME=5", {"HOROVOD_CYCLE_TIME": "5"}),
                       ("HorovodStrategy, HOROVOD_CYCLE_TIME=0.1", {"HOROVOD_CYCLE_TIME": "0.1"}),
                       ("HorovodStrategy, HOROVOD_FUSION_THRESHOLD=0", {"HOROVOD_FUSION_THRESHOLD": "0"})):
        speed = run("horovod", args.steps, env)
        print(f"{label:<52}{speed:>9.2f}{speed / mwms:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
