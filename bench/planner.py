"""The planner's predictions against measured steps, one run.

The candidates include pipelines (`stage:p;data:N/p`, 1F1B and GPipe, p to
4p micro-batches; tfdist.planner.pipeline), trained as `pipelined_transformer`
on the same devices (stages on the processes with `--engine processes`).

The model: `tfdist.models.Transformer`, 2 + 2 layers, d_model 256, 4 heads of
64, d_ff 2048, vocabulary 8192, 4 experts in every other FFN (GShard MoE),
dropout 0, Adam (14.7M parameters); batch 8 rows of 32 source and target
tokens: a step where the weights (their update and gradient sum) weigh as much
as the tokens' compute, so layouts differ. On 4 virtual devices of one process
(`split_cpu(4)`, sharing this machine's cores):

1. the machine's calibration (`tfdist.planner.probe`, cached per machine);
2. `tfdist.plan(...)` over every valid `data x model` layout;
3. a spread of the ranked candidates (default 10: the first, the last and
   evenly between), each trained in a fresh process (2 warm-up steps, then
   `--steps` timed `fit` steps of the same random batches), its seconds per
   step (the least of `--repeats` processes: a run on virtual devices now and
   then stalls whole, at about 2.5x its step) and its activation peak per device (TF's CPU allocator peak during the
   timed steps over its level before them, divided by the devices: the
   devices of one process share the allocator and run the same program);
4. Spearman's rank correlation between predicted and measured step times
   (target >= 0.8), the measured step of the planner's pick against the
   fastest measured (target within 10%), and each candidate's predicted
   step bytes against the measured (target within 15%).

    python bench/planner.py [--candidates 10] [--steps 12] [--repeats 2] [--devices 4]
"""

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BATCH, LENGTH = 8, 32


def _config():
    from tfdist.config import TransformerConfig

    return TransformerConfig(vocab_size=8192, d_model=256, num_heads=4, d_kv=64, d_ff=2048,
                             num_encoder_layers=2, num_decoder_layers=2, max_length=LENGTH,
                             moe_experts=4, dropout=0.0)


def case(args):
    """One candidate: JSON `{s_per_step, activations}` on stdout (mesh engine), or
    `{s_per_step}` in `--result` (processes: run in every task of a launched job)."""
    devices = None
    if args.engine == "processes":
        from tfdist.cluster import ClusterConfig

        devices = list(ClusterConfig.from_env().start(threads=1, inter_op_threads=2))
    else:
        from tfdist.devices import split_cpu

        split_cpu(args.devices)
    import time

    import keras
    import numpy as np
    import tensorflow as tf

    if args.inter_op:
        tf.config.threading.set_inter_op_parallelism_threads(args.inter_op)
    from tfdist.models import SequenceCrossentropy, Transformer
    from tfdist.strategies import MeshStrategy

    config = _config()
    rng = np.random.default_rng(0)
    rows = BATCH * (2 + args.steps)
    source = rng.integers(3, config.vocab_size, (rows, LENGTH)).astype("int32")
    target = rng.integers(3, config.vocab_size, (rows, LENGTH)).astype("int32")
    keras.utils.set_random_seed(1)
    pipelined = "layers:" in args.layout
    if pipelined:  # a pipeline: its stages placed on the mesh's devices
        from tfdist.models.transformer_pipeline import pipelined_transformer
        from tfdist.pipeline.layout import PipelinePlan

        plan = PipelinePlan.from_mesh(args.mesh_shape, args.layout,
                                      config.num_encoder_layers + config.num_decoder_layers,
                                      args.num_microbatches, args.schedule)
        if devices is None:
            devices = [d.name for d in tf.config.list_logical_devices("CPU")][:plan.mesh.size]
        model = pipelined_transformer(config, plan, devices)
        model.compile(keras.optimizers.Adam(1e-4), SequenceCrossentropy(config.vocab_size))
        devices = devices if args.engine == "processes" else None
    else:
        strategy = MeshStrategy(args.mesh_shape, args.layout, devices=devices)
        with strategy.scope():
            model = Transformer(config, name="transformer")
            model.compile(keras.optimizers.Adam(1e-4), SequenceCrossentropy(config.vocab_size))
    warm = slice(0, 2 * BATCH)
    model.fit((source[warm], target[warm]), target[warm], batch_size=BATCH, verbose=0)
    timed = slice(2 * BATCH, None)
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    start = time.perf_counter()
    model.fit((source[timed], target[timed]), target[timed], batch_size=BATCH, verbose=0,
              shuffle=False)
    seconds = (time.perf_counter() - start) / args.steps
    if devices is not None:
        with open(args.result, "w") as f:
            json.dump({"s_per_step": seconds}, f)
        return
    if pipelined:  # stages differ: the process's peak over the devices says little
        print(json.dumps({"s_per_step": seconds}))
        return
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    print(json.dumps({"s_per_step": seconds, "activations": (peak - before) / args.devices}))


def _measure(candidate, args):
    runs = [_measure_once(candidate, args) for _ in range(args.repeats)]
    return min(runs, key=lambda r: r["s_per_step"])


def _measure_once(candidate, args):
    command = [sys.executable, os.path.abspath(__file__), "--case", "--mesh_shape",
               str(candidate.mesh.shape), "--layout", str(candidate.mesh.rules), "--steps",
               str(args.steps), "--devices", str(args.devices), "--engine", args.engine]
    if candidate.pipeline is not None:
        command += ["--num_microbatches", str(candidate.pipeline.num_microbatches),
                    "--schedule", candidate.pipeline.schedule_name]
    if args.engine == "processes":
        import io
        import tempfile

        from tfdist.launch.local import run_local

        with tempfile.TemporaryDirectory() as tmp:
            result, log = os.path.join(tmp, "case.json"), io.StringIO()
            status = run_local(command + ["--result", result], args.devices, pin_cores=True,
                               linger_s=2.0, out=log)
            if status or not os.path.exists(result):
                raise RuntimeError(f"{candidate.mesh} failed:\n{log.getvalue()[-3000:]}")
            with open(result) as f:
                return json.load(f)
    out = subprocess.run(command, capture_output=True, text=True,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    if out.returncode:
        raise RuntimeError(f"{candidate.mesh} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _transient(candidate) -> int:
    """Bytes a step adds on a device: its activations and its weights' gradients."""
    return candidate.memory.activations + candidate.memory.gradients


def spearman(xs, ys) -> float:
    """Spearman's rank correlation (no ties expected among float timings)."""
    import numpy as np

    rx = np.argsort(np.argsort(xs))
    ry = np.argsort(np.argsort(ys))
    return float(np.corrcoef(rx, ry)[0, 1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mesh_shape", default="data:4")
    parser.add_argument("--layout", default="batch:data")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--candidates", type=int, default=10)
    parser.add_argument("--inter_op", type=int, default=0)
    parser.add_argument("--num_microbatches", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="1f1b", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engine", default="mesh", choices=["mesh", "processes"],
                        help="mesh: virtual devices of one process; processes: one device per "
                             "process, pinned one per core")
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--refresh", action="store_true", help="re-measure the calibration")
    args = parser.parse_args()
    if args.case:
        return case(args)

    import tfdist
    from tfdist.planner import Calibration

    calibration = Calibration.measure([args.devices], refresh=args.refresh, engine=args.engine)
    plan = tfdist.plan(_config(), args.devices, global_batch=BATCH, length=LENGTH,
                       calibration=calibration, engine=args.engine)
    ranked = plan.ranked
    k = min(args.candidates, len(ranked))
    picks = sorted({round(i * (len(ranked) - 1) / max(1, k - 1)) for i in range(k)})
    print(f"{len(ranked)} valid layouts on {args.devices} devices ({args.engine}); measuring "
          f"{len(picks)}, a fresh job each, {args.steps} timed steps", flush=True)
    rows = []
    for i in picks:
        c = ranked[i]
        got = _measure(c, args)
        rows.append((i + 1, c, got))
        print(f"  #{i + 1:<2} {str(c.mesh.shape):<15} {c.description:<48} predicted "
              f"{1e3 * c.step_seconds:7.1f} ms  measured {1e3 * got['s_per_step']:7.1f} ms  "
              + (f"step bytes predicted {_transient(c) / 2**20:6.1f} MiB measured "
                 f"{got['activations'] / 2**20:6.1f} MiB" if "activations" in got else ""),
              flush=True)
    predicted = [c.step_seconds for _, c, _ in rows]
    measured = [got["s_per_step"] for _, _, got in rows]
    rho = spearman(predicted, measured)
    pick = measured[0] / min(measured)
    act = [_transient(c) / got["activations"] for _, c, got in rows if "activations" in got]
    print(f"Spearman rank correlation predicted vs measured: {rho:.3f} (target >= 0.8)")
    print(f"planner's pick measured {1e3 * measured[0]:.1f} ms = {pick:.3f}x the fastest "
          f"measured {1e3 * min(measured):.1f} ms (target <= 1.10)")
    if act:
        print(f"step bytes (activations + gradients) predicted / measured: min {min(act):.2f}, "
              f"max {max(act):.2f} (target 0.85-1.15)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
