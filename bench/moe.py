"""MoE vs dense FFNs of the same FLOPs, as step-time ratios measured in one run.

MoE: E=8 experts, d_model 256, expert d_ff H=1024, group size 128, trained
with Adam as a residual block on [batch, length, d_model] inputs, on one
device, 1x2 and 1x4 (`experts:model`; the dense FFNs Megatron-split with
`d_ff:model`). Like is compared with like:

  (a) capacity mode (top-2, capacity factor 1.25) against a dense FFN with
      d_ff = k * cf * H = 2560, the FLOPs of the padded expert buffers:
      target <= 1.15 (routing overhead <= 15%). GShard's one-hot dispatch
      (`dispatch="one_hot"`) is timed against the same FFN.
  (b) dropless top-2 against d_ff = k * H = 2048: target <= 1.25.
  Also top-4 (cf 1.25, against d_ff = 5120) and expert choice (cf 2.5,
  against d_ff = 2560).

"routing" is the fraction of the MoE's step not explained by its FLOPs:
1 - dense / moe, against the dense FFN of the same FLOPs. On a 2-core CPU the
virtual devices share two cores: ratios compare the layers, not scaling.

A last table splits one device's top-2 (cf 1.25) layer, forward and backward
with no optimizer, into its parts, timed interleaved in one process (so a
slow spell falls on all alike): the whole MoE layer (index and one-hot
dispatch), its experts' two matmuls alone on buffers of the same shape, and
the dense FFN of the same FLOPs. routing = 1 - experts alone / layer; the
experts' matmuls against the dense ones show what batching them costs.

Each case runs in its own process; the cases of a mesh are interleaved over
`--rounds` rounds (case order rotated each round), so a slow spell of the
machine falls on every case alike. A process's time is its fastest of
`--repeats` epochs (as `timeit` takes the minimum: on this shared 2-core
virtual machine whole epochs run up to 2x slower when a core is taken from
us, and noise only ever adds time). A ratio is the median over rounds of the
ratio within a round (MoE and its dense FFN timed minutes apart at most), with
its min and max over rounds.

    python bench/moe.py [--steps 30] [--repeats 5] [--rounds 3]
"""

import argparse
import json
import os
import subprocess
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

D_MODEL, D_FF, EXPERTS, GROUP = 256, 1024, 8, 128
BATCH, LENGTH = 16, 64
MESHES = ("data:1;model:1", "data:1;model:2", "data:1;model:4")

# name: (MoE arguments, the dense FFN's d_ff with the same FLOPs)
CASES = {
    "top-2 cf 1.25": (dict(top_k=2, capacity_factor=1.25), int(2 * 1.25 * D_FF)),
    "top-2 one-hot": (dict(top_k=2, capacity_factor=1.25, dispatch="one_hot"),
                      int(2 * 1.25 * D_FF)),
    "dropless top-2": (dict(top_k=2, dropless=True), 2 * D_FF),
    "top-4 cf 1.25": (dict(top_k=4, capacity_factor=1.25), int(4 * 1.25 * D_FF)),
    "expert choice 2.5": (dict(routing="expert_choice", capacity_factor=2.5),
                          int(2.5 * D_FF)),
}
TARGETS = {"top-2 cf 1.25": 1.15, "dropless top-2": 1.25}


def build(moe_args=None, d_ff=None):
    x = inputs = keras.Input((LENGTH, D_MODEL))
    if moe_args is not None:
        y = MoE(EXPERTS, D_FF, group_size=GROUP, name="moe", **moe_args)(x)
    else:
        h = ShardedDense(d_ff, ("d_model", "d_ff"), activation="relu",
                         output_sharded=True, use_bias=False)(x)
        y = ShardedDense(D_MODEL, ("d_ff", "d_model"), input_sharded=True, use_bias=False)(h)
    return keras.Model(inputs, x + y)


def prepare(mesh, layout, x, y, **build_args):
    """A compiled, traced and warmed-up model under `MeshStrategy(mesh, layout)`."""
    strategy = MeshStrategy(mesh, layout)
    with strategy.scope():
        model = build(**build_args)
        model.compile(keras.optimizers.Adam(1e-3), "mse")
    model.fit(x[: 4 * BATCH], y[: 4 * BATCH], batch_size=BATCH, verbose=0)  # trace, warm up
    return model


def time_fit(model, x, y, steps):
    """Seconds per step of one epoch, and the fraction of tokens dropped in it."""
    start = time.perf_counter()
    history = model.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False)
    seconds = (time.perf_counter() - start) / steps
    return seconds, history.history.get("moe_dropped", [0.0])[-1]


def breakdown(repeats=40):
    """One device: ms (fastest of `repeats`, interleaved) of the top-2 layer's parts."""
    import tensorflow as tf

    x = tf.random.normal([BATCH, LENGTH, D_MODEL])
    capacity = int(np.ceil(2 * GROUP * 1.25 / EXPERTS))
    groups = BATCH * LENGTH // GROUP

    def step(call, weights):
        @tf.function
        def run():
            with tf.GradientTape() as tape:
                y = call()
                loss = tf.reduce_sum(y * y)
            return tf.add_n([tf.reduce_sum(g) for g in tape.gradient(loss, weights)])
        return run

    parts = {}
    for name, dispatch in (("MoE layer, index", "index"), ("MoE layer, one-hot", "one_hot")):
        layer = MoE(EXPERTS, D_FF, group_size=GROUP, top_k=2, capacity_factor=1.25,
                    dispatch=dispatch)
        layer.build(x.shape)
        parts[name] = step(lambda layer=layer: layer(x, training=True),
                           layer.trainable_variables)
    buffers = tf.random.normal([EXPERTS, groups * capacity, D_MODEL])
    wi = tf.Variable(tf.random.normal([EXPERTS, D_MODEL, D_FF]) * 0.05)
    wo = tf.Variable(tf.random.normal([EXPERTS, D_FF, D_MODEL]) * 0.05)
    parts["experts alone"] = step(lambda: tf.matmul(tf.nn.relu(tf.matmul(buffers, wi)), wo),
                                  [wi, wo])
    d_ff = CASES["top-2 cf 1.25"][1]
    tokens = tf.reshape(x, [-1, D_MODEL])
    dense_wi = tf.Variable(tf.random.normal([D_MODEL, d_ff]) * 0.05)
    dense_wo = tf.Variable(tf.random.normal([d_ff, D_MODEL]) * 0.05)
    parts[f"dense d_ff {d_ff}"] = step(
        lambda: tf.matmul(tf.nn.relu(tf.matmul(tokens, dense_wi)), dense_wo), [dense_wi, dense_wo])
    times = {name: [] for name in parts}
    for run in parts.values():
        run()  # trace, warm up
    for _ in range(repeats):
        for name, run in parts.items():
            start = time.perf_counter()
            run().numpy()
            times[name].append(time.perf_counter() - start)
    return {name: min(t) for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3,
                        help="Interleaved rounds: one process per case per round.")
    parser.add_argument("--meshes", default=",".join(MESHES), help="Comma-separated meshes.")
    parser.add_argument("--only", default=None, help=argparse.SUPPRESS)  # one case, one process
    args = parser.parse_args()
    logging.set_verbosity(logging.WARNING)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * BATCH, LENGTH, D_MODEL)).astype("float32")
    y = rng.normal(size=(args.steps * BATCH, LENGTH, D_MODEL)).astype("float32")
    tokens = BATCH * LENGTH
    if args.only == "breakdown":
        print(f"RESULT {json.dumps(breakdown())}")
        return
    print(f"MoE bench: E={EXPERTS}, d_model {D_MODEL}, expert d_ff {D_FF}, group {GROUP}; "
          f"{tokens} tokens/step; a process's time: fastest of {args.repeats} epochs of "
          f"{args.steps} steps; {args.rounds} interleaved rounds; "
          f"ratio = MoE / dense FFN of equal FLOPs, median [min, max] over rounds")
    print(f"{'mesh':<16}{'case':<19}{'moe ms':>8}{'dense ms':>9}{'d_ff':>6}{'ratio':>7}"
          f"{'[min,':>7}{'max]':>6}{'target':>7}{'routing':>8}{'dropped':>8}")
    for mesh in args.meshes.split(","):
        # One process per model (several models built and fitted in one process
        # crashed TF here: a segfault in a compute thread).
        seconds, dropped = {}, {}
        keys = sorted({d_ff for _, d_ff in CASES.values()}) + list(CASES)
        if args.only is not None:
            key = args.only if args.only in CASES else int(args.only)
            if key in CASES:
                model = prepare(mesh, "experts:model", x, y, moe_args=CASES[key][0])
            else:
                model = prepare(mesh, "d_ff:model", x, y, d_ff=key)
            runs = [time_fit(model, x, y, args.steps) for _ in range(args.repeats)]
            print(f"RESULT {min(s for s, _ in runs)!r} {runs[-1][1]!r}")
            return
        for round_ in range(args.rounds):
            shift = round_ % len(keys)
            for key in keys[shift:] + keys[:shift]:
                out = subprocess.run(
                    [sys.executable, __file__, "--meshes", mesh, "--only", str(key),
                     "--steps", str(args.steps), "--repeats", str(args.repeats)],
                    capture_output=True, text=True, check=True).stdout
                step, fraction = out.split("RESULT ")[-1].split()
                seconds.setdefault(key, []).append(float(step))
                dropped[key] = float(fraction)
        for name, (_, d_ff) in CASES.items():
            ratios = np.array(seconds[name]) / np.array(seconds[d_ff])  # within each round
            ratio = float(np.median(ratios))
            moe, dense = np.median(seconds[name]), np.median(seconds[d_ff])
            target = f"{TARGETS[name]:.2f}" if name in TARGETS else ""
            print(f"{mesh:<16}{name:<19}{moe * 1e3:>8.1f}{dense * 1e3:>9.1f}{d_ff:>6}"
                  f"{ratio:>7.2f}{ratios.min():>7.2f}{ratios.max():>6.2f}{target:>7}"
                  f"{1 - 1 / ratio:>8.0%}{dropped[name]:>8.3f}", flush=True)
        for key in keys:  # each round's process, to see which side varies
            print(f"{mesh:<16}{str(key):<19}ms per round: "
                  + " ".join(f"{s * 1e3:.1f}" for s in seconds[key]), flush=True)
    if args.only is None:
        out = subprocess.run([sys.executable, __file__, "--meshes", MESHES[0], "--only",
                              "breakdown"], capture_output=True, text=True, check=True).stdout
        parts = json.loads(out.split("RESULT ")[-1])
        experts = parts["experts alone"]
        print(f"\none device, top-2 cf 1.25, forward and backward, no optimizer (fastest of "
              f"40, interleaved in one process):")
        for name, seconds in parts.items():
            routing = f"routing {1 - experts / seconds:.0%}" if name.startswith("MoE") else ""
            print(f"  {name:<20}{seconds * 1e3:>7.1f} ms  {routing}".rstrip())
        dense = [v for k, v in parts.items() if k.startswith("dense")][0]
        print(f"  experts' batched matmuls / dense matmuls of the same FLOPs: "
              f"{experts / dense:.2f}")


if __name__ == "__main__":
    main()
