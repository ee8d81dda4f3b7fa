"""MoE vs dense FFNs of the same FLOPs, as step-time ratios of paired steps.

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

How it is timed: this shared 2-core virtual machine loses a core for seconds
at a time (one process's epochs of identical work vary 170-530 ms), so a
case and its dense FFN are built in one process and their training steps
alternate, one MoE step and one dense step, each first in every other pair
(`train_on_batch`, which returns after the step): each pair sees the same
machine. The ratio is the median over the pairs of MoE step / dense step,
with its quartiles. Each case runs in its own process, so no two cases share
TF's state (an earlier version of this bench saw a segfault with several
models fitted in one process; two per process ran cleanly on 1x1, 1x2, 1x4).

"routing" is the fraction of the MoE's step not explained by its FLOPs:
1 - dense / moe, against the dense FFN of the same FLOPs. On a 2-core CPU the
virtual devices share two cores: ratios compare the layers, not scaling.

A last table splits one device's top-2 (cf 1.25) layer, forward and backward
with no optimizer, into its parts, timed interleaved in one process: the whole
MoE layer (index and one-hot dispatch), its experts' two matmuls alone on
buffers of the same shape, the same matmuls on the buffers flattened into one
matrix (the floor of a dense FFN's kernels; wrong math for distinct experts),
and the dense FFN of the same FLOPs. routing = 1 - experts alone / layer; the
batched matmuls against the flat ones show what TF's batched kernel costs.

    python bench/moe.py [--pairs 30] [--batch 64] [--meshes ...]
"""

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tfdist.devices import split_cpu  # noqa: E402

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


def paired_steps(mesh, case, pairs):
    """Seconds of `pairs` alternating training steps of a case and its dense FFN.

    Returns `(moe seconds, dense seconds, the MoE's mean dropped fraction)`.
    """
    moe_args, d_ff = CASES[case]
    rng = np.random.default_rng(0)
    batches = 4  # distinct batches, cycled (dropless buffer sizes vary with the routing)
    x = rng.normal(size=(batches * BATCH, LENGTH, D_MODEL)).astype("float32")
    y = rng.normal(size=(batches * BATCH, LENGTH, D_MODEL)).astype("float32")
    models = (prepare(mesh, "experts:model", x, y, moe_args=moe_args),
              prepare(mesh, "d_ff:model", x, y, d_ff=d_ff))
    seconds, dropped = ([], []), []
    for step in range(pairs):
        rows = slice(step % batches * BATCH, (step % batches + 1) * BATCH)
        order = list(zip(models, seconds))
        for model, times in order if step % 2 == 0 else order[::-1]:  # each goes first alike
            start = time.perf_counter()
            logs = model.train_on_batch(x[rows], y[rows], return_dict=True)
            times.append(time.perf_counter() - start)
            if model is models[0]:
                dropped.append(float(logs["moe_dropped"]))
    return seconds[0], seconds[1], float(np.mean(dropped))


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
    flat = tf.reshape(buffers, [-1, D_MODEL])
    wi_0, wo_0 = tf.Variable(wi[0]), tf.Variable(wo[0])
    parts["experts flattened"] = step(  # one expert's weights for all rows: wrong math, same FLOPs
        lambda: tf.matmul(tf.nn.relu(tf.matmul(flat, wi_0)), wo_0), [wi_0, wo_0])
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
    global BATCH
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=30,
                        help="Alternating MoE / dense training steps per case.")
    parser.add_argument("--batch", type=int, default=BATCH,
                        help=f"Sequences of {LENGTH} tokens a step.")
    parser.add_argument("--meshes", default=",".join(MESHES), help="Comma-separated meshes.")
    parser.add_argument("--cases", default=",".join(CASES), help="Comma-separated cases.")
    parser.add_argument("--only", default=None, help=argparse.SUPPRESS)  # one case, one process
    args = parser.parse_args()
    BATCH = args.batch
    logging.set_verbosity(logging.WARNING)
    if args.only == "breakdown":
        print(f"RESULT {json.dumps(breakdown())}")
        return
    if args.only is not None:
        moe, dense, dropped = paired_steps(args.meshes, args.only, args.pairs)
        print(f"RESULT {json.dumps(dict(moe=moe, dense=dense, dropped=dropped))}")
        return
    print(f"MoE bench: E={EXPERTS}, d_model {D_MODEL}, expert d_ff {D_FF}, group {GROUP}; "
          f"{BATCH * LENGTH} tokens/step; {args.pairs} alternating steps of each case and "
          f"its dense FFN in one process; ratio = MoE step / dense step, median [quartiles] "
          f"over the pairs")
    print(f"{'mesh':<16}{'case':<19}{'moe ms':>8}{'dense ms':>9}{'d_ff':>6}{'ratio':>7}"
          f"{'[q1,':>7}{'q3]':>6}{'target':>7}{'routing':>8}{'dropped':>8}", flush=True)
    for mesh in args.meshes.split(","):
        for case in args.cases.split(","):
            out = subprocess.run(
                [sys.executable, __file__, "--meshes", mesh, "--only", case,
                 "--pairs", str(args.pairs), "--batch", str(args.batch)],
                capture_output=True, text=True, check=True).stdout
            result = json.loads(out.split("RESULT ")[-1])
            moe, dense = np.array(result["moe"]), np.array(result["dense"])
            ratios = moe / dense
            ratio, (q1, q3) = float(np.median(ratios)), np.percentile(ratios, [25, 75])
            target = f"{TARGETS[case]:.2f}" if case in TARGETS else ""
            print(f"{mesh:<16}{case:<19}{np.median(moe) * 1e3:>8.1f}"
                  f"{np.median(dense) * 1e3:>9.1f}{CASES[case][1]:>6}{ratio:>7.2f}{q1:>7.2f}"
                  f"{q3:>6.2f}{target:>7}{1 - 1 / ratio:>8.0%}{result['dropped']:>8.3f}",
                  flush=True)
    out = subprocess.run([sys.executable, __file__, "--only", "breakdown",
                          "--batch", str(args.batch)],
                         capture_output=True, text=True, check=True).stdout
    parts = json.loads(out.split("RESULT ")[-1])
    experts = parts["experts alone"]
    print("\none device, top-2 cf 1.25, forward and backward, no optimizer (fastest of "
          "40, interleaved in one process):")
    for name, seconds in parts.items():
        routing = f"routing {1 - experts / seconds:.0%}" if name.startswith("MoE") else ""
        print(f"  {name:<28}{seconds * 1e3:>7.1f} ms  {routing}".rstrip())
    dense = [v for k, v in parts.items() if k.startswith("dense")][0]
    print(f"  experts' batched matmuls / dense matmuls of the same FLOPs: {experts / dense:.2f}; "
          f"/ the same matmuls flattened: {experts / parts['experts flattened']:.2f}")


if __name__ == "__main__":
    main()
