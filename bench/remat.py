"""Activation recomputation on the NMT Transformer: peak memory and step time, with and without.

`tfdist.models.Transformer` (d_model 128, 4 heads of 32, d_ff 512, 4 + 4
layers, V 1000, dropout 0.1, one CPU device, Adam, `SequenceCrossentropy`),
full-length batches of `--batch` sentences at each of `--lengths`, with
`TransformerConfig(remat=...)` "none" (every block keeps its activations for
the backward pass), "full" (each block keeps only its inputs and is recomputed
in the backward pass) and "selective" (only the attention cores, whose
`[b, H, L, L]` tensors are recomputed). Each case is a fresh subprocess: one step
traces and warms up, then the peak RSS is reset (`/proc/self/clear_refs`) and
`--steps` more steps run; reported is the peak (`VmHWM`) above the RSS at the
reset (so weights, optimizer slots and the traced program are excluded: what
remains is activations, gradients and temporaries).

Memory is measured in processes with `TF_ENABLE_ONEDNN_OPTS=0` and
`MALLOC_MMAP_THRESHOLD_=65536`: with oneDNN on, TF's CPU allocator keeps
every freed tensor in its pool (the RSS after the warm-up already holds the
warm-up's peak, and the steps after it add nothing), and glibc by default
raises its mmap threshold to 32 MiB and keeps large freed blocks too. With
both off the RSS follows the live tensors. Step times (median of the steps)
come from separate processes with TF's defaults (oneDNN on), as users run.
Cases alternate (none, full, selective, twice) and the smaller of each case's
two peaks and times is reported, as ratios against "none".

Targets (issue 18): peak memory with remat <= 0.5x at the longer length, step
time <= 1.35x (full recomputation runs every forward pass twice: about 1.33x
of forward + backward at best).

    python bench/remat.py [--lengths 64,256] [--batch 16] [--steps 3] [--xla]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tfdist.testing.memory import RSS_FOLLOWS_TENSORS  # noqa: E402
VOCAB = 1000
MODES = ("none", "full", "selective")


def job(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from tfdist.testing.memory import reset_peak_rss, status_mib
    import keras
    import numpy as np

    from tfdist.models import SequenceCrossentropy, Transformer, TransformerConfig

    config = TransformerConfig(vocab_size=VOCAB, d_model=128, num_heads=4, d_kv=32, d_ff=512,
                               num_encoder_layers=4, num_decoder_layers=4,
                               max_length=args.length, dropout=0.1, remat=args.remat)
    keras.utils.set_random_seed(0)
    model = Transformer(config)
    model.compile(keras.optimizers.Adam(1e-4), SequenceCrossentropy(VOCAB),
                  jit_compile=args.xla)
    rng = np.random.default_rng(0)
    shape = (args.batch, args.length)
    source, target = (rng.integers(3, VOCAB, size=shape).astype("int32") for _ in range(2))
    decoder_input = np.concatenate([np.ones((args.batch, 1), "int32"), target[:, :-1]], 1)
    model.train_on_batch((source, decoder_input), target)  # trace, warm up
    before = reset_peak_rss()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        model.train_on_batch((source, decoder_input), target)
        times.append(time.perf_counter() - start)
    print(json.dumps({"peak_mib": status_mib("VmHWM") - before,
                      "step_s": statistics.median(times)}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="64,256")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--xla", action="store_true", help="jit_compile the step")
    parser.add_argument("--remat", choices=MODES)
    parser.add_argument("--length", type=int)
    args = parser.parse_args()
    if args.remat is not None:
        return job(args)
    lengths = [int(n) for n in args.lengths.split(",")]
    print(f"NMT Transformer 4+4 layers, d_model 128, d_ff 512, batch {args.batch}, one CPU "
          f"device, Adam, XLA {'on' if args.xla else 'off'}; {args.steps} steps after a "
          f"warm-up; peak RSS above the RSS after the warm-up")
    print(f"{'length':>6} | {'mode':>9} | {'peak MiB':>8} | {'memory':>6} | {'s/step':>6} | "
          f"{'time':>5}")
    worst = {}
    for length in lengths:
        runs = {mode: [] for mode in MODES}
        for mode in MODES * 2:
            command = [sys.executable, os.path.abspath(__file__), f"--remat={mode}",
                       f"--length={length}", f"--batch={args.batch}", f"--steps={args.steps}"]
            command += ["--xla"] if args.xla else []
            memory_env = dict(os.environ, **RSS_FOLLOWS_TENSORS)
            for env, key in ((memory_env, "peak_mib"), (dict(os.environ), "step_s")):
                out = subprocess.run(command, capture_output=True, text=True, check=True,
                                     env=env)
                runs[mode].append({key: json.loads(out.stdout.strip().splitlines()[-1])[key]})
        best = {mode: {k: min(r[k] for r in runs[mode] if k in r) for k in ("peak_mib", "step_s")}
                for mode in MODES}
        for mode in MODES:
            memory = best[mode]["peak_mib"] / best["none"]["peak_mib"]
            step = best[mode]["step_s"] / best["none"]["step_s"]
            worst[mode] = (memory, max(step, worst.get(mode, (0, 0))[1]))
            print(f"{length:>6} | {mode:>9} | {best[mode]['peak_mib']:>8.0f} | {memory:>5.2f}x | "
                  f"{best[mode]['step_s']:>6.3f} | {step:>4.2f}x")
    for mode in ("full", "selective"):
        memory, step = worst[mode]
        print(f"{mode}: memory {memory:.2f}x at length {max(lengths)} (target <= 0.5x: "
              f"{'met' if memory <= 0.5 else 'NOT met'}), step time {step:.2f}x at most "
              f"(target <= 1.35x: {'met' if step <= 1.35 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
