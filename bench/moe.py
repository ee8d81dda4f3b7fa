"""MoE vs a dense FFN with the same activated FLOPs, as ratios measured in one run.

MoE: E=8 experts, top-2, capacity factor 1.25, d_model 256, expert d_ff 1024,
group size 128. Dense: one FFN with d_ff = top_k * 1024 = 2048, i.e. the
hidden units each MoE token activates. Both are a residual block trained with
Adam on [batch, length, d_model] inputs. Meshes: one device, 1x2 and 1x4 (MoE
with `experts:model`, the dense FFN Megatron-split with `d_ff:model`).

Reports step time, tokens/s, the MoE/dense step-time ratio (target <= 1.3)
and the fraction of tokens dropped for capacity. On a 2-core CPU the virtual
devices share two cores: ratios compare the two layers, not device scaling.

    python bench/moe.py [--steps 20]
"""

import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfdist.testing.devices import split_cpu  # noqa: E402

split_cpu(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import logging  # noqa: E402

from tfdist.layers import MoE, ShardedDense  # noqa: E402
from tfdist.strategies import MeshStrategy  # noqa: E402

D_MODEL, D_FF, EXPERTS, TOP_K, GROUP = 256, 1024, 8, 2, 128
BATCH, LENGTH = 16, 64
MESHES = ("data:1;model:1", "data:1;model:2", "data:1;model:4")


def build(kind):
    x = inputs = keras.Input((LENGTH, D_MODEL))
    if kind == "moe":
        y = MoE(EXPERTS, D_FF, top_k=TOP_K, capacity_factor=1.25, group_size=GROUP, name="moe")(x)
    else:
        h = ShardedDense(TOP_K * D_FF, ("d_model", "d_ff"), activation="relu",
                         output_sharded=True, use_bias=False)(x)
        y = ShardedDense(D_MODEL, ("d_ff", "d_model"), input_sharded=True, use_bias=False)(h)
    return keras.Model(inputs, x + y)


def measure(kind, mesh, layout, x, y, steps):
    strategy = MeshStrategy(mesh, layout)
    with strategy.scope():
        model = build(kind)
        model.compile(keras.optimizers.Adam(1e-3), "mse")
    model.fit(x[: 2 * BATCH], y[: 2 * BATCH], batch_size=BATCH, verbose=0)  # trace, warm up
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False)
    seconds = (time.perf_counter() - start) / steps
    dropped = history.history.get("moe_dropped", [0.0])[-1]
    return seconds, dropped


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    logging.set_verbosity(logging.WARNING)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * BATCH, LENGTH, D_MODEL)).astype("float32")
    y = rng.normal(size=(args.steps * BATCH, LENGTH, D_MODEL)).astype("float32")
    tokens = BATCH * LENGTH
    print(f"MoE bench: E={EXPERTS} top-{TOP_K} cf 1.25, d_model {D_MODEL}, expert d_ff {D_FF}, "
          f"group {GROUP}; dense d_ff {TOP_K * D_FF}; {tokens} tokens/step, {args.steps} steps")
    print(f"{'mesh':<16}{'moe ms':>9}{'dense ms':>10}{'moe/dense':>11}{'moe tok/s':>11}{'dropped':>9}")
    for mesh in MESHES:
        moe, dropped = measure("moe", mesh, "experts:model", x, y, args.steps)
        dense, _ = measure("dense", mesh, "d_ff:model", x, y, args.steps)
        print(f"{mesh:<16}{moe * 1e3:>9.1f}{dense * 1e3:>10.1f}{moe / dense:>11.2f}"
              f"{tokens / moe:>11.0f}{dropped:>9.3f}")


if __name__ == "__main__":
    main()
