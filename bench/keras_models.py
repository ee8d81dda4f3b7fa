"""A keras-hub Gemma backbone with its own layout map over processes, same run.

Each case is a fresh job started with tfdist.launch, one process per core
(process i pinned to core i, one thread):

- one process: the plain Keras model (the baseline);
- data parallel over 2 processes: `tfdist.distribution.DataParallel`;
- FSDP over 2 processes: Gemma's `get_layout_map` on a `(batch 2, model 1)` mesh,
  each gathered weight gathered again for the backward pass (the default),
  kept from the forward pass (`reshard_after_forward=False`), and gathered
  again but one layer ahead (`prefetch=True`);
- tensor parallel over 2 processes: the same map on `(batch 1, model 2)`;
- ZeRO over 2 processes: data parallelism with `zero_stage=1` (Adam's slots
  split over the processes, gradients all-reduced whole in the fused buckets,
  every weight's new shard all-gathered into its kept whole copy after each
  step, in one flat buffer), `zero_stage=2` (gradients reduce-scattered per
  weight instead) and `zero_stage=3` (weights split too, gathered on read);
- idle: the same job building no model (the memory baseline).

Reported per case: steps/s and the ratio to one process and to data
parallelism, bytes of weights + Adam slots on each device (read from the
variables' components), and each process's peak RSS above the idle job's
(`VmHWM` of every task, read by the controller when the case ends).

    python bench/keras_models.py [--steps 10] [--batch 16] [--length 128]
        [--hidden_dim 256] [--intermediate_dim 2048]
"""

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIG = dict(vocabulary_size=8192, num_layers=2, num_query_heads=4, num_key_value_heads=2,
              hidden_dim=256, intermediate_dim=2048, head_dim=64)
CASES = {  # name: (processes, mesh shape or None, ModelParallel options)
    "one": (1, None, {}), "data_parallel": (2, "dp", {}), "fsdp": (2, (2, 1), {}),
    "fsdp_kept": (2, (2, 1), {"reshard_after_forward": False}),
    "fsdp_prefetch": (2, (2, 1), {"prefetch": True}),
    "tensor_parallel": (2, (1, 2), {}), "zero1": (2, "dp", {"zero_stage": 1}),
    "zero2": (2, "dp", {"zero_stage": 2}),
    "zero3": (2, "dp", {"zero_stage": 3}), "idle": (2, "idle", {}),
}
REPORTED = ("one", "data_parallel", "fsdp", "fsdp_kept", "fsdp_prefetch", "tensor_parallel",
            "zero1", "zero2", "zero3")


def _peak_rss_of_job():
    """VmHWM (MiB) of every process running this job's command line."""
    from tfdist.testing.memory import job_status

    return sorted(v / 2 ** 20 for v in job_status("VmHWM").values())


def job(args):
    """One case, in every task of a launched job; the controller measures."""
    import time

    from tfdist.cluster import ClusterConfig

    devices = ClusterConfig.from_env().start(threads=1)
    import keras
    import keras_hub
    import numpy as np
    import tensorflow as tf
    from absl import logging

    import tfdist.distribution as td
    from tfdist.testing.memory import device_bytes, optimizer_bytes

    logging.set_verbosity(logging.WARNING)
    processes, shape, options = CASES[args.case]
    result = {"case": args.case, "processes": processes}
    if shape == "idle":
        result["peak_rss_mib"] = _peak_rss_of_job()
        json.dump(result, open(args.result, "w"))
        return
    if shape is None:
        strategy = tf.distribute.OneDeviceStrategy(devices[0])
    elif shape == "dp":
        strategy = td.DataParallel(devices=devices, **options)
    else:
        mesh = keras.distribution.DeviceMesh(shape, ("batch", "model"), devices)
        strategy = td.ModelParallel(layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh),
                                    batch_dim_name="batch", devices=devices, **options)
    rng = np.random.default_rng(0)
    rows = (args.steps + 1) * args.batch
    x = {"token_ids": rng.integers(0, CONFIG["vocabulary_size"], (rows, args.length)),
         "padding_mask": np.ones((rows, args.length), "int32")}
    y = rng.normal(size=(rows, args.length, CONFIG["hidden_dim"])).astype("float32")
    with strategy.scope():
        model = keras_hub.models.GemmaBackbone(**CONFIG)
        model.compile(keras.optimizers.Adam(1e-4), "mse")
    first = {k: v[:args.batch] for k, v in x.items()}
    model.fit(first, y[:args.batch], batch_size=args.batch, verbose=0)  # trace, warm up
    start = time.perf_counter()
    model.fit({k: v[args.batch:] for k, v in x.items()}, y[args.batch:], batch_size=args.batch,
              verbose=0, shuffle=False)
    result["s_per_step"] = (time.perf_counter() - start) / args.steps
    result["device_bytes"] = [device_bytes(model, i) for i in range(max(processes, 1))]
    result["slot_bytes"] = [optimizer_bytes(model, i) for i in range(max(processes, 1))]
    result["peak_rss_mib"] = _peak_rss_of_job()
    json.dump(result, open(args.result, "w"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--hidden_dim", type=int, default=CONFIG["hidden_dim"])
    parser.add_argument("--intermediate_dim", type=int, default=CONFIG["intermediate_dim"])
    parser.add_argument("--cases", default=",".join(CASES),
                        help="comma-separated cases to run (one, data_parallel and idle always run)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of every case, interleaved; each case reports its fastest")
    parser.add_argument("--case", choices=list(CASES))
    parser.add_argument("--result")
    args = parser.parse_args()
    CONFIG.update(hidden_dim=args.hidden_dim, intermediate_dim=args.intermediate_dim)
    if args.case:
        return job(args)
    from tfdist.launch.local import run_local

    print(f"keras-hub Gemma {CONFIG}, batch {args.batch} x {args.length}, Adam, {args.steps} "
          f"timed steps; one core and one thread per process")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        wanted = set(args.cases.split(",")) | {"one", "data_parallel", "idle"}
        runs = [(case, n) for _ in range(args.repeats) for case, (n, _, _) in CASES.items()
                if case in wanted]
        for case, n in runs:
            path = os.path.join(tmp, f"{case}.json")
            command = [sys.executable, os.path.abspath(__file__), f"--case={case}",
                       f"--steps={args.steps}", f"--batch={args.batch}",
                       f"--length={args.length}", f"--hidden_dim={args.hidden_dim}",
                       f"--intermediate_dim={args.intermediate_dim}", f"--result={path}"]
            status = run_local(command, n, pin_cores=True, linger_s=2.0,
                               out=open(os.devnull, "w"))
            if status or not os.path.exists(path):
                print(f"{case}: the job failed (status {status})")
                return 1
            result = json.load(open(path))
            if case in results and "s_per_step" in result:  # the fastest run; its peaks
                result["s_per_step"] = min(result["s_per_step"], results[case]["s_per_step"])
            results[case] = result
    one, dp = results["one"], results["data_parallel"]
    idle = results["idle"]["peak_rss_mib"]
    one_bytes = one["device_bytes"][0]
    print(f"{'case':<18}{'procs':>6}{'s/step':>8}{'vs one':>8}{'vs DP':>7}"
          f"{'weights+slots/device':>22}{'of one':>8}  peak RSS above idle (MiB)")
    for case in (c for c in REPORTED if c in results):
        r = results[case]
        above = [f"{p - min(idle):.0f}" for p in r["peak_rss_mib"]]
        print(f"{case:<18}{r['processes']:>6}{r['s_per_step']:>8.3f}"
              f"{one['s_per_step'] / r['s_per_step']:>7.2f}x{dp['s_per_step'] / r['s_per_step']:>6.2f}x"
              f"{max(r['device_bytes']):>22,}{max(r['device_bytes']) / one_bytes:>8.2f}  "
              f"{', '.join(above)}")
    for name in ("zero1", "zero2"):
        if name not in results:
            continue
        zero, slots = results[name], dp["slot_bytes"][0]
        print(f"ZeRO-{name[-1]} targets: Adam slot bytes/device 1/2 of data parallel's "
              f"({max(zero['slot_bytes']):,} / {slots:,} = {max(zero['slot_bytes']) / slots:.3f}), "
              f"step <= 1.1x data parallel ({zero['s_per_step'] / dp['s_per_step']:.2f}x)")
    if not {"fsdp", "fsdp_kept", "tensor_parallel"} <= set(results):
        return 0
    fsdp, kept, tp = results["fsdp"], results["fsdp_kept"], results["tensor_parallel"]
    prefetched = (f"; prefetch {results['fsdp_prefetch']['s_per_step'] / dp['s_per_step']:.2f}x"
                  if "fsdp_prefetch" in results else "")
    print(f"targets: FSDP bytes/device <= 1/2 + 5% of one ({max(fsdp['device_bytes']) / one_bytes:.2f}), "
          f"FSDP step <= 1.3x data parallel ({fsdp['s_per_step'] / dp['s_per_step']:.2f}x; "
          f"kept {kept['s_per_step'] / dp['s_per_step']:.2f}x{prefetched}), "
          f"tensor parallel faster than one process ({one['s_per_step'] / tp['s_per_step']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
