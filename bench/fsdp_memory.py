"""FSDP's peak memory: the gathered weight gathered again for backward, or kept.

A stack of `--layers` plain Keras `Dense(d, d)` layers, every kernel split over
the batch axis of a `(batch 2,)` mesh (FSDP) on 2 virtual CPU devices in one
process, Adam, a small batch (so activations are negligible). Each case is a
fresh subprocess: one `fit` step traces and warms up, then the peak RSS is
reset (`/proc/self/clear_refs`) and `--steps` more steps run; reported is the
peak (`VmHWM`) above the RSS at the reset (weights, slots and the traced
program excluded), the same run for both cases. The subprocesses run with
`TF_ENABLE_ONEDNN_OPTS=0` and `MALLOC_MMAP_THRESHOLD_=65536` so that the RSS
follows the live tensors: with oneDNN on, TF's CPU allocator keeps freed
tensors in its pool (the warm-up step would already hold the peak), and glibc
keeps large freed blocks once its dynamic mmap threshold has grown (before
this, the bench measured mostly the pools: 276-314 MiB either way).

- `reshard_after_forward=True` (default): each layer's whole kernel lives only
  for its forward matmul and is gathered again for its backward pass;
- `reshard_after_forward=False`: every whole kernel is kept from the forward
  to the backward pass.

Expected difference: (layers - 1) x kernel bytes x 2 devices.

    python bench/fsdp_memory.py [--layers 8] [--d 2048] [--steps 3]
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tfdist.testing.memory import RSS_FOLLOWS_TENSORS  # noqa: E402


def job(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from tfdist.testing.memory import reset_peak_rss, status_mib
    import tfdist

    tfdist.split_cpu(2)
    import keras
    import numpy as np

    import tfdist.distribution as td

    mesh = td.DeviceMesh((2,), ("batch",), ["cpu:0", "cpu:1"])
    layout_map = td.LayoutMap(mesh)
    layout_map[r"dense_\d+/kernel"] = ("batch", None)
    strategy = td.ModelParallel(layout_map=layout_map, reshard_after_forward=args.reshard)
    with strategy.scope():
        model = keras.Sequential([keras.Input((args.d,))] + [
            keras.layers.Dense(args.d, activation="tanh", name=f"dense_{i}")
            for i in range(args.layers)])
        model.compile(keras.optimizers.Adam(1e-4), "mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, args.d)).astype("float32")
    model.fit(x, x, batch_size=8, epochs=1, verbose=0)  # trace, warm up
    before = reset_peak_rss()
    model.fit(x, x, batch_size=8, epochs=args.steps, verbose=0)
    print(json.dumps({"reshard": args.reshard, "before_mib": before,
                      "peak_mib": status_mib("VmHWM")}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--reshard", type=int, choices=(0, 1))
    args = parser.parse_args()
    if args.reshard is not None:
        return job(args)
    kernel_mib = args.d * args.d * 4 / 2**20
    print(f"{args.layers} Dense({args.d}) layers, kernels {kernel_mib:.0f} MiB each, FSDP over "
          f"2 virtual devices in one process, Adam, batch 8, {args.steps} steps")
    rows = {}
    for reshard in (1, 0, 1, 0):  # interleaved, twice
        out = subprocess.run([sys.executable, os.path.abspath(__file__), f"--reshard={reshard}",
                              f"--layers={args.layers}", f"--d={args.d}",
                              f"--steps={args.steps}"], capture_output=True, text=True,
                             check=True, env=dict(os.environ, **RSS_FOLLOWS_TENSORS))
        result = json.loads(out.stdout.strip().splitlines()[-1])
        rows.setdefault(reshard, []).append(result["peak_mib"] - result["before_mib"])
    for reshard, label in ((1, "gathered again for backward"), (0, "gathered weight kept")):
        print(f"reshard_after_forward={bool(reshard)!s:<5} ({label}): step peak above "
              f"the RSS before it {', '.join(f'{m:.0f}' for m in rows[reshard])} MiB")
    saved = min(rows[0]) - min(rows[1])
    expected = (args.layers - 1) * kernel_mib * 2
    print(f"saved {saved:.0f} MiB; expected about {expected:.0f} MiB "
          f"((layers - 1) x kernel x 2 devices)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
