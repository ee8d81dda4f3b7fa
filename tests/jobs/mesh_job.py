"""A job for tests/cluster: equivalence of a mesh over worker processes.

Run in every task (python -m tfdist.launch ... -- tests/jobs/mesh_job.py
MESH [CASES]); the controller builds MeshStrategy(MESH) over the devices of all tasks,
runs the `job_cases` named in CASES (comma-separated; by default the token MLP,
the XC head and the plain embedding) against their single-device references,
and prints one report line per case. With
--steps_forever it trains until killed (for the fault tests).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tfdist.cluster import ClusterConfig  # noqa: E402

devices = ClusterConfig.from_env().start()

import job_cases  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfdist.models import build_token_mlp, make_copy_task  # noqa: E402
from tfdist.strategies import MeshStrategy  # noqa: E402

mesh = sys.argv[1]
strategy = MeshStrategy(mesh, "batch:data;d_ff:model;vocab:model;classes:model", devices=devices)
print(f"mesh {mesh} over {sorted({d.split('/device')[0] for d in devices})}", flush=True)

if "--steps_forever" in sys.argv:
    x, y = make_copy_task(16 * 1000)
    with strategy.scope():
        model = build_token_mlp()
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # "training" once the first step has run: the trace is done, steps are under way
    # (under load the trace alone took over 90 s, and a kill during it is not the case).
    started = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch == 0 and print("training", flush=True))
    model.fit(x, y, batch_size=16, epochs=100, verbose=0, callbacks=[started])
    sys.exit(0)

cases = sys.argv[2] if len(sys.argv) > 2 else "token_mlp,xc_head,plain_embedding"
for case in filter(None, cases.split(",")):
    print(f"{case} {mesh}: {getattr(job_cases, case)(strategy)}", flush=True)

# Model averaging over the same devices (one copy per device, all processes):
# period 1 with SGD is synchronous SGD.
from tfdist.strategies import ModelAveragingStrategy  # noqa: E402

averaging = ModelAveragingStrategy(period=1, devices=devices)
xa = np.random.default_rng(1).normal(size=(10 * 16, 8)).astype("float32")
ya = np.random.default_rng(2).normal(size=(10 * 16, 2)).astype("float32")


def mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


with averaging.scope():
    averaged = mlp()
reference = mlp()
averaged.set_weights(reference.get_weights())
averaged.fit(xa, ya, batch_size=16, shuffle=False, verbose=0)
reference.fit(xa, ya, batch_size=16, shuffle=False, verbose=0)
diff = max(float(np.abs(a - b).max() / np.abs(b).max())
           for a, b in zip(averaged.get_weights(), reference.get_weights()))
assert diff < 1e-5, diff
print(f"averaging {mesh}: period 1 SGD vs synchronous SGD {diff:.1e}", flush=True)
