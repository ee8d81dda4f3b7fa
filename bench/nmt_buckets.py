"""Length buckets vs one bucket of max_length: real target tokens/s of the demo's model on 2x2.

The model, mesh, data and batching are `make demo`'s: an MoE Transformer
(2 + 2 layers, d_model 64, d_ff 256, 4 heads of 16, 4 experts in every other
FFN, top-2) on `data:2;model:2` (4 virtual CPUs, one process) with
`batch:data;heads:model;d_ff:model;vocab:model;experts:model`, trained with
Adam on token batches (`tfdist.data.nmt.make_dataset`, `--max_tokens` padded
positions per batch) of the built-in English -> German number corpus.
Two models are built and trained in the same run, alternating fit by fit
(so load from other processes falls on both alike):

- "one bucket": every batch padded to `max_length` (`bucket_width=max_length`),
  the only choice before collectives took keys for any shape;
- "buckets": `bucket_width=8`, as `train_nmt.py` now runs on every mesh; each
  batch has its own padded length, so its collectives use the step's shape id.

Reported per `max_length` (the demo's 24, and 64): real (non-padding) target
tokens per second over the timed steps (after an untimed warm-up that traces
the step for every bucket shape), their ratio, and beside it the ideal ratio:
padded positions of one bucket over padded positions of buckets, for the
same pairs (if a step's time were proportional to its padded positions).
Target: measured >= 0.9x ideal. Also the model-FLOPs utilisation of each: the
analytic training FLOPs of the real tokens (below) per second over a matmul
peak measured in the same run (one 1024^3 float32 `tf.matmul` on all cores).

Training FLOPs = 3 x forward = 6 x multiply-adds of the real tokens only:
projections and FFNs per token (the MoE counts its top-k experts and its
router), attention scores and values over the real lengths (`len^2` per
sequence and self-attention, source x target for cross-attention), and the
tied output projection per target token. Padding, capacity slack and
recomputed work are not useful FLOPs and are not counted.

    python bench/nmt_buckets.py [--max_lengths 24,64] [--rounds 5] [--steps 12] [--quick]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MESH, LAYOUT = "data:2;model:2", "batch:data;heads:model;d_ff:model;vocab:model;experts:model"
DEMO = dict(d_model=64, d_ff=256, num_heads=4, d_kv=16, num_encoder_layers=2,
            num_decoder_layers=2, dropout=0.05, moe_experts=4)
DEMO_MAX_TOKENS, WIDTH = 1536, 8
KINDS = ("one bucket", "buckets")


def matmul_peak_flops(tf, n=1024, repeats=20) -> float:
    """Best float32 FLOP/s of an `n^3` matmul over `repeats` runs (all cores)."""
    a = tf.random.normal((n, n))
    b = tf.random.normal((n, n))
    run = tf.function(lambda: tf.reduce_sum(tf.matmul(a, b)))
    run().numpy()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run().numpy()
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


def batch_train_flops(cfg, source, target) -> float:
    """Analytic training FLOPs of one batch's real tokens (`source`/`target`: `[B, L]` ids)."""
    s_len = (source != 0).sum(1).astype(float)
    t_len = (target != 0).sum(1).astype(float)
    d, hk, f = cfg.d_model, cfg.num_heads * cfg.d_kv, cfg.d_ff

    def ffn(layer):  # multiply-adds per token
        if cfg.moe_experts and layer % 2 == 1:
            return cfg.moe_top_k * 2 * d * f + d * cfg.moe_experts
        return 2 * d * f

    macs = 0.0
    for layer in range(cfg.num_encoder_layers):
        macs += s_len.sum() * (4 * d * hk + ffn(layer)) + 2 * hk * (s_len ** 2).sum()
    for layer in range(cfg.num_decoder_layers):
        macs += t_len.sum() * (4 * d * hk + 2 * d * hk + ffn(layer))  # self; cross q, o
        macs += s_len.sum() * 2 * d * hk                                # cross k, v
        macs += 2 * hk * ((t_len ** 2).sum() + (s_len * t_len).sum())
    macs += t_len.sum() * d * cfg.vocab_size
    return 6.0 * macs


def step_timer(keras):
    """A Keras callback whose `times` are the wall times of its fit's steps."""

    class StepTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    return StepTimer()


def padded_positions(lengths, max_length, width) -> int:
    return int(sum(-(-n // width) * width for n in lengths)) if width < max_length else \
        len(lengths) * max_length


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--max_lengths", default="24,64")
    parser.add_argument("--rounds", type=int, default=5, help="timed fits per model")
    parser.add_argument("--steps", type=int, default=12, help="steps per timed fit")
    parser.add_argument("--num_train", type=int, default=20_000)
    parser.add_argument("--quick", action="store_true", help="tiny run, every code path")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.num_train = 2, 3, 3000

    from tfdist.devices import split_cpu

    split_cpu(4)
    import keras
    import tensorflow as tf

    from tfdist.config import TransformerConfig
    from tfdist.data import nmt
    from tfdist.models import SequenceCrossentropy, Transformer
    from tfdist.models.nmt_eval import TokenCount
    from tfdist.strategies import MeshStrategy

    corpus = nmt.number_corpus("de", num_train=args.num_train, num_test=10, seed=0)
    pairs = list(corpus.train)
    tokenizer = nmt.train_tokenizer([s for p in pairs for s in p],
                                    os.path.join(tempfile.mkdtemp(), "spm"), vocab_size=256,
                                    vocab_multiple=8, seed=0)
    strategy = MeshStrategy(MESH, LAYOUT)
    multiple = strategy.num_replicas_in_sync * 8  # MoE groups: 8 rows per replica
    peak = matmul_peak_flops(tf)
    print(f"nmt_buckets: {len(pairs)} pairs, vocabulary {tokenizer.vocab_size}, mesh {MESH}; "
          f"matmul peak {peak / 1e9:.1f} GFLOP/s; {args.rounds} timed fits x {args.steps} "
          f"steps per model and max_length", flush=True)
    rows = []
    for max_length in (int(n) for n in args.max_lengths.split(",")):
        max_tokens = max(DEMO_MAX_TOKENS, multiple * max_length)
        cfg = TransformerConfig(vocab_size=tokenizer.vocab_size, max_length=max_length, **DEMO)
        encoded = nmt.encode_pairs(pairs, tokenizer, max_length)
        lengths = [max(len(s), len(t)) + 1 for s, t in zip(encoded.source, encoded.target)]
        ideal = padded_positions(lengths, max_length, max_length) / \
            padded_positions(lengths, max_length, WIDTH)
        runs = {}
        for kind in KINDS:
            width = max_length if kind == "one bucket" else WIDTH
            dataset = nmt.make_dataset(pairs, tokenizer, max_tokens, batch_multiple=multiple,
                                       max_length=max_length, bucket_width=width, seed=0,
                                       repeat=True)
            warmup = nmt.make_dataset(pairs, tokenizer, max_tokens, batch_multiple=multiple,
                                      max_length=max_length, bucket_width=width,
                                      shuffle=False)
            first_of_each = {}  # one batch of every bucket shape, for the untimed warm-up
            for batch in warmup:
                first_of_each.setdefault(batch[1].shape[1], batch)
            keras.utils.set_random_seed(0)
            with strategy.scope():
                model = Transformer(cfg, name="transformer")
                model.compile(keras.optimizers.Adam(1e-3, beta_2=0.98, epsilon=1e-9),
                              SequenceCrossentropy(cfg.vocab_size, 0.1), metrics=[TokenCount()])
            shapes = list(first_of_each.values())
            spec = warmup.element_spec
            model.fit(tf.data.Dataset.from_generator(lambda s=shapes: iter(s),
                                                     output_signature=spec),
                      epochs=1, verbose=0)
            runs[kind] = dict(model=model, data=iter(dataset), times=[], tokens=[], flops=[],
                              buckets=sorted(first_of_each), spec=spec)
        for _ in range(args.rounds):
            for kind in KINDS:
                run = runs[kind]
                batches = [next(run["data"]) for _ in range(args.steps)]
                run["flops"].append(sum(batch_train_flops(cfg, b[0][0].numpy(), b[1].numpy())
                                        for b in batches))
                feed = tf.data.Dataset.from_generator(lambda b=batches: iter(b),
                                                      output_signature=run["spec"]).prefetch(2)
                timer = step_timer(keras)
                history = run["model"].fit(feed, epochs=1, verbose=0, callbacks=[timer])
                run["times"].append(sum(timer.times))
                run["tokens"].append(history.history["tokens"][-1])
        speeds = {}
        for kind in KINDS:
            run = runs[kind]
            rates = [n / t for n, t in zip(run["tokens"], run["times"])]
            speeds[kind] = statistics.median(rates)
            mfu = statistics.median(f / t for f, t in zip(run["flops"], run["times"])) / peak
            rows.append((max_length, kind, f"{max_tokens}", ",".join(map(str, run["buckets"])),
                         f"{speeds[kind]:,.0f}", f"{min(rates):,.0f}-{max(rates):,.0f}",
                         f"{100 * mfu:.2f}%"))
        ratio = speeds["buckets"] / speeds["one bucket"]
        rows.append((max_length, "buckets / one bucket", "", "", f"{ratio:.2f}x",
                     f"ideal {ideal:.2f}x", f"{ratio / ideal:.2f} of ideal (target >= 0.9)"))
        print(f"max_length {max_length}: buckets {ratio:.2f}x one bucket, ideal {ideal:.2f}x",
              flush=True)
    print("\n| max_length | batches | max_tokens | padded lengths | real target tokens/s "
          "(median) | min-max | MFU |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")


if __name__ == "__main__":
    main()
