"""MeshStrategy: per-device memory and step time, as ratios to baselines in the same run.

Model: two Megatron MLP blocks (d_model 256 -> d_ff 2048 -> d_model 256, the
d_ff axis split by "d_ff:model") trained with Adam on [batch, d_model] inputs.

Reports, for each mesh:
- weight + Adam-slot bytes held by one device, and the ratio to one device;
- steps/s, and the ratio to the one-device mesh measured in this run.
And MeshStrategy("data:2") against tf.distribute.MirroredStrategy on the same
two devices (pure data parallel), to show the strategy's own overhead.

On a 2-core CPU the virtual devices share two cores, so step-time ratios
measure overhead, not speed-up; on real accelerators they measure scaling.

    python bench/mesh_strategy.py [--steps 30]
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfdist.devices import split_cpu  # noqa: E402

split_cpu(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import logging  # noqa: E402

from tfdist.layers import ShardedDense  # noqa: E402
from tfdist.strategies import MeshStrategy  # noqa: E402
from tfdist.testing.memory import device_bytes  # noqa: E402

D_MODEL, D_FF, BATCH = 256, 2048, 64
MESHES = ["data:1;model:1", "data:2;model:1", "data:1;model:2", "data:1;model:4", "data:2;model:2"]


def build():
    x = inp = keras.Input((D_MODEL,))
    for i in range(2):
        h = ShardedDense(D_FF, ("d_model", "d_ff"), activation="relu", output_sharded=True,
                         name=f"mlp{i}_in")(x)
        x = x + ShardedDense(D_MODEL, ("d_ff", "d_model"), input_sharded=True, name=f"mlp{i}_out")(h)
    return keras.Model(inp, x)


def measure(strategy, steps, x, y):
    with strategy.scope():
        model = build()
        model.compile(keras.optimizers.Adam(1e-3), "mse")
    model.fit(x[: 2 * BATCH], y[: 2 * BATCH], batch_size=BATCH, verbose=0)  # trace + warm up
    start = time.perf_counter()
    model.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False)
    seconds = time.perf_counter() - start
    return device_bytes(model), steps / seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    logging.set_verbosity(logging.WARNING)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * BATCH, D_MODEL)).astype("float32")
    y = rng.normal(size=(args.steps * BATCH, D_MODEL)).astype("float32")

    print(f"MeshStrategy bench: 2 MLP blocks d_model={D_MODEL} d_ff={D_FF}, Adam, "
          f"global batch {BATCH}, {args.steps} steps, layout d_ff:model")
    print(f"{'mesh':<16}{'bytes/device':>14}{'ratio':>8}{'steps/s':>10}{'ratio':>8}")
    base = None
    for mesh in MESHES:
        nbytes, speed = measure(MeshStrategy(mesh, "batch:data;d_ff:model"), args.steps, x, y)
        base = base or (nbytes, speed)
        print(f"{mesh:<16}{nbytes:>14,}{nbytes / base[0]:>8.3f}{speed:>10.2f}{speed / base[1]:>8.2f}")

    devices = ["/cpu:0", "/cpu:1"]
    _, mirrored = measure(tf.distribute.MirroredStrategy(devices), args.steps, x, y)
    _, mesh = measure(MeshStrategy("data:2", devices=devices), args.steps, x, y)
    print(f"data parallel on 2 devices: MirroredStrategy {mirrored:.2f} steps/s, "
          f"MeshStrategy {mesh:.2f} steps/s, ratio {mesh / mirrored:.2f}")


if __name__ == "__main__":
    main()
