"""tfdist's NMT Transformer vs the same model built from Keras-Hub layers, one run.

Both models: encoder-decoder, pre-layer-norm, d_model 256, 4 heads of 64,
d_ff 1024 (ReLU), 3 + 3 layers, V=8000, dropout 0.1, sinusoidal positions,
one embedding shared by source and target and tied to the output projection,
a final layer norm after each stack, embeddings scaled by sqrt(d_model).
tfdist: `tfdist.models.Transformer`. Keras-Hub: `ReversibleEmbedding`
(tied) + `SinePositionEncoding`, `TransformerEncoder`/`TransformerDecoder`
with `normalize_first=True`. (Keras-Hub's attention and dense layers carry
biases; tfdist's attention has none.) One CPU device, no strategy.

1. Training: Adam(1e-3) on the same random batches (batch 48, source and
   target lengths drawn from [12, 24], padded to 24; `[BOS] + target` feeds
   the decoder), one `train_on_batch` per step. tfdist uses its
   `SequenceCrossentropy` (label smoothing 0.1, mean over real tokens);
   Keras-Hub uses `SparseCategoricalCrossentropy(from_logits=True)` with
   padding masked by sample weights (it has no label smoothing for sparse
   labels, so tfdist does slightly more work). Reports real target tokens per
   step over the median step time, after a warm-up step that traces and
   compiles, with `jit_compile` off and on.
2. Beam search, beam 4, 24 new tokens, a batch of 32 sources: tfdist's
   `translate(beam_size=4, alpha=0.6)` (KV cache, GNMT length penalty,
   finished-hypothesis set, 2K candidates per step) vs
   `keras_hub.samplers.BeamSampler(num_beams=4)` (top K of K * V, no length
   penalty) driving the Keras-Hub decoder with its self-attention cache and a
   cross-attention cache computed once (encoder states, mask and cross caches
   are repeated per beam and captured rather than gathered every step: the
   strongest Keras-Hub baseline we could write). Both under `tf.function`,
   XLA off and on. Fresh random weights with the EOS embedding row zeroed, so
   the EOS logit is 0 while the others spread around it and no hypothesis
   ends: both searches run all 24 steps (the output notes any EOS that does
   appear). Reports sentences per second over the best of the timed runs.

The two models alternate step by step (training) and run by run (search),
so load from other processes falls on both alike. Ratios are tfdist /
Keras-Hub in this run with the same batches; targets: training >= 1.2x,
beam search >= 2x. On a shared 2-core machine absolute numbers move with the
load; the ratios less so. A full run takes under 4 minutes on 2 cores (more
when other processes share them); `--quick` (tiny sizes, every code path)
about a minute and a half, mostly tracing and XLA compilation.

    python bench/nmt.py [--train_steps 5] [--decode_repeats 3] [--quick] [--xla both|off|on]
"""

import argparse
import dataclasses
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import logging  # noqa: E402

from tfdist.models import SequenceCrossentropy, Transformer, TransformerConfig  # noqa: E402

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BEAM, ALPHA = 4, 0.6
KINDS = ("tfdist", "keras-hub")


@dataclasses.dataclass(frozen=True)
class Sizes:
    vocab: int = 8000
    d_model: int = 256
    heads: int = 4
    d_ff: int = 1024
    layers: int = 3
    batch: int = 48
    length: int = 24          # source and target (padded) length
    warmup_steps: int = 1     # untimed: tracing and XLA compilation
    decode_batch: int = 32
    new_tokens: int = 24


QUICK = Sizes(vocab=64, d_model=32, heads=2, d_ff=64, layers=1, batch=8, length=8,
              warmup_steps=1, decode_batch=4, new_tokens=6)


def make_batches(rng, rows, length, vocab):
    """Source, decoder input and target `[rows, length]` int32, lengths in [length/2, length]."""
    source = np.zeros((rows, length), "int32")
    target = np.zeros((rows, length), "int32")
    for row in range(rows):
        n = rng.integers(length // 2, length + 1)
        source[row, :n] = rng.integers(3, vocab, n)
        m = rng.integers(length // 2, length + 1)
        target[row, :m - 1] = rng.integers(3, vocab, m - 1)
        target[row, m - 1] = EOS_ID
    decoder_input = np.concatenate([np.full((rows, 1), BOS_ID, "int32"), target[:, :-1]], 1)
    decoder_input[decoder_input == EOS_ID] = PAD_ID  # [BOS] + target without its EOS
    return source, decoder_input, target


# -- the two models ----------------------------------------------------------


def tfdist_model(s):
    return Transformer(TransformerConfig(
        vocab_size=s.vocab, d_model=s.d_model, num_heads=s.heads, d_kv=s.d_model // s.heads,
        d_ff=s.d_ff, num_encoder_layers=s.layers, num_decoder_layers=s.layers,
        max_length=max(s.length, s.new_tokens), dropout=0.1))


class KerasHubNMT:
    """The same Transformer from Keras-Hub layers; `.model` is the functional training model."""

    def __init__(self, s):
        self.sizes = s
        init = keras.initializers.RandomNormal(stddev=s.d_model ** -0.5)
        self.embedding = keras_hub.layers.ReversibleEmbedding(
            s.vocab, s.d_model, tie_weights=True, embeddings_initializer=init, name="embedding")
        self.positions = keras_hub.layers.SinePositionEncoding(name="positions")
        self.dropout = keras.layers.Dropout(0.1)
        self.encoders = [keras_hub.layers.TransformerEncoder(
            s.d_ff, s.heads, dropout=0.1, normalize_first=True, layer_norm_epsilon=1e-6,
            name=f"encoder_{i}") for i in range(s.layers)]
        self.decoders = [keras_hub.layers.TransformerDecoder(
            s.d_ff, s.heads, dropout=0.1, normalize_first=True, layer_norm_epsilon=1e-6,
            name=f"decoder_{i}") for i in range(s.layers)]
        self.encoder_norm = keras.layers.LayerNormalization(epsilon=1e-6, name="encoder_norm")
        self.decoder_norm = keras.layers.LayerNormalization(epsilon=1e-6, name="decoder_norm")
        source = keras.Input((None,), dtype="int32", name="source_ids")
        decoder_input = keras.Input((None,), dtype="int32", name="decoder_input_ids")
        memory = self.encode(source)
        states = self.embed(decoder_input)
        for layer in self.decoders:
            states = layer(states, memory, encoder_padding_mask=keras.ops.not_equal(source, 0))
        logits = self.embedding(self.decoder_norm(states), reverse=True)
        self.model = keras.Model([source, decoder_input], logits, name="keras_hub_nmt")

    def embed(self, ids, start=0, training=None):
        x = self.embedding(ids) * (self.sizes.d_model ** 0.5)
        return self.dropout(x + self.positions(x, start_index=start), training=training)

    def encode(self, source, training=None):
        x = self.embed(source, training=training)
        for layer in self.encoders:
            x = layer(x, padding_mask=keras.ops.not_equal(source, 0), training=training)
        return self.encoder_norm(x)

    def beam_search(self, source):
        """Best beam `[b, 1 + new_tokens]` (BOS first) from `BeamSampler`, with caches."""
        s = self.sizes
        batch, d_head = tf.shape(source)[0], s.d_model // s.heads
        mask = tf.not_equal(source, 0)
        memory = self.encode(source, training=False)
        length = s.new_tokens + 1
        # Seed: the BOS step fills each layer's cross-attention cache once.
        x = self.embed(tf.fill([batch, 1], BOS_ID), training=False)
        self_caches, cross_caches = [], []
        for layer in self.decoders:
            x, self_cache, cross_cache = layer(
                x, memory, encoder_padding_mask=mask,
                self_attention_cache=tf.zeros([batch, 2, length, s.heads, d_head]),
                self_attention_cache_update_index=0,
                cross_attention_cache=tf.zeros([batch, 2, tf.shape(source)[1], s.heads, d_head]),
                cross_attention_cache_update_index=0, training=False)
            self_caches.append(self_cache)
            cross_caches.append(cross_cache)
        # Row b * BEAM + k is beam k of source b, as in BeamSampler.
        memory, mask = tf.repeat(memory, BEAM, 0), tf.repeat(mask, BEAM, 0)
        cross_caches = [tf.repeat(c, BEAM, 0) for c in cross_caches]

        def next_logits(prompt, cache, index):
            position = index - 1
            x = self.embed(tf.slice(prompt, [0, position], [-1, 1]), start=position,
                           training=False)
            new_caches = []
            for layer, self_cache, cross_cache in zip(self.decoders, cache, cross_caches):
                x, self_cache, _ = layer(
                    x, memory, encoder_padding_mask=mask, self_attention_cache=self_cache,
                    self_attention_cache_update_index=position, cross_attention_cache=cross_cache,
                    cross_attention_cache_update_index=None, training=False)
                new_caches.append(self_cache)
            logits = self.embedding(self.decoder_norm(x), reverse=True)
            return logits[:, 0], x[:, 0], tuple(new_caches)

        prompt = tf.concat([tf.fill([batch, 1], BOS_ID),
                            tf.zeros([batch, s.new_tokens], "int32")], 1)
        prompt_mask = tf.concat([tf.ones([batch, 1], tf.bool),
                                 tf.zeros([batch, s.new_tokens], tf.bool)], 1)
        sampler = keras_hub.samplers.BeamSampler(num_beams=BEAM)
        return sampler(next_logits, prompt, cache=tuple(self_caches), index=1, mask=prompt_mask)


# -- measurements ------------------------------------------------------------


def train_tokens_per_second(s, data, steps, jit):
    """{kind: real target tokens / median step time}, steps of the two models interleaved."""
    source, decoder_input, target = data
    weights = (target != PAD_ID).astype("float32")
    models = {}
    for kind in KINDS:
        keras.utils.set_random_seed(1)
        if kind == "tfdist":
            model, loss = tfdist_model(s), SequenceCrossentropy(s.vocab, label_smoothing=0.1)
        else:
            model = KerasHubNMT(s).model
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(keras.optimizers.Adam(1e-3), loss, jit_compile=jit)
        models[kind] = model
    times = {kind: [] for kind in KINDS}
    for step in range(s.warmup_steps + steps):  # the first steps trace and compile
        rows = slice(step * s.batch, (step + 1) * s.batch)
        for kind in KINDS if step % 2 else KINDS[::-1]:  # alternate who goes first
            start = time.perf_counter()
            loss = models[kind].train_on_batch(
                (source[rows], decoder_input[rows]), target[rows],
                sample_weight=None if kind == "tfdist" else weights[rows], return_dict=True)
            if step >= s.warmup_steps:
                times[kind].append(time.perf_counter() - start)
            if not np.isfinite(loss["loss"]):
                raise RuntimeError(f"{kind} training diverged at step {step}: {loss}")
    tokens = np.count_nonzero(target[s.warmup_steps * s.batch:]) / steps  # per step
    return {kind: tokens / np.median(times[kind]) for kind in KINDS}


def zero_eos_row(variable):
    variable.assign(tf.tensor_scatter_nd_update(variable, [[EOS_ID]],
                                                tf.zeros([1, variable.shape[1]])))


def beam_sentences_per_second(s, source, repeats, jit):
    """{kind: (sentences / best time, rows whose output holds an EOS)}, runs interleaved."""
    keras.utils.set_random_seed(2)
    model = tfdist_model(s)
    zero_eos_row(model.target_embedding.embeddings)
    hub = KerasHubNMT(s)
    zero_eos_row(hub.embedding.embeddings)
    searches = {
        "tfdist": lambda src: model.translate(src, beam_size=BEAM, alpha=ALPHA,
                                              max_length=s.new_tokens, jit_compile=jit),
        "keras-hub": tf.function(hub.beam_search, jit_compile=jit),
    }
    source = tf.constant(source)
    results = {}
    for kind in KINDS:
        ids = searches[kind](source).numpy()  # trace, compile, warm up
        results[kind] = [float("inf"), int(np.any(ids == EOS_ID, axis=1).sum())]
    for repeat in range(repeats):
        for kind in KINDS if repeat % 2 else KINDS[::-1]:
            start = time.perf_counter()
            searches[kind](source).numpy()
            results[kind][0] = min(results[kind][0], time.perf_counter() - start)
    return {kind: (len(source) / best, eos) for kind, (best, eos) in results.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_steps", type=int, default=5, help="timed training steps")
    parser.add_argument("--decode_repeats", type=int, default=3, help="timed beam searches")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, every code path: a smoke run")
    parser.add_argument("--xla", choices=["both", "off", "on"], default="both",
                        help="measure with XLA off, on, or both")
    args = parser.parse_args()
    logging.set_verbosity(logging.WARNING)
    s = QUICK if args.quick else Sizes()
    steps = 1 if args.quick else args.train_steps
    repeats = 1 if args.quick else args.decode_repeats
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    data = make_batches(rng, (s.warmup_steps + steps) * s.batch, s.length, s.vocab)
    print(f"NMT bench: V={s.vocab}, d_model {s.d_model}, {s.heads} heads, d_ff {s.d_ff}, "
          f"{s.layers}+{s.layers} layers, dropout 0.1; train batch {s.batch} x {s.length} "
          f"({s.warmup_steps} warm-up + {steps} timed steps); beam {BEAM}, {s.new_tokens} new "
          f"tokens, {s.decode_batch} sources (best of {repeats}); 1 CPU device, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    rows, notes = [], []
    jits = {"both": (False, True), "off": (False,), "on": (True,)}[args.xla]
    for jit in jits:
        speed = train_tokens_per_second(s, data, steps, jit)
        rows.append(("training tokens/s", jit, speed["tfdist"], speed["keras-hub"], 1.2))
    for jit in jits:
        speed = beam_sentences_per_second(s, data[0][:s.decode_batch], repeats, jit)
        (ours, our_eos), (theirs, their_eos) = speed["tfdist"], speed["keras-hub"]
        rows.append((f"beam-{BEAM} sentences/s", jit, ours, theirs, 2.0))
        if our_eos or their_eos:
            notes.append(f"XLA {'on' if jit else 'off'}: EOS in {our_eos} tfdist and "
                         f"{their_eos} keras-hub outputs (searches may have stopped early)")
    print()
    print("| measure | XLA | tfdist | keras-hub | tfdist/keras-hub | target |")
    print("|---|---|---:|---:|---:|---:|")
    for name, jit, ours, theirs, target in rows:
        met = "met" if ours / theirs >= target else "not met"
        print(f"| {name} | {'on' if jit else 'off'} | {ours:,.1f} | {theirs:,.1f} | "
              f"{ours / theirs:.2f}x | >= {target:g}x {met} |")
    for note in notes:
        print(f"note: {note}")
    print()
    ratios = {(name.split()[0], jit): ours / theirs for name, jit, ours, theirs, _ in rows}
    training = ", ".join(f"{ratios['training', jit]:.2f}x XLA {'on' if jit else 'off'}"
                         for jit in jits)
    beam = ", ".join(f"{ratios[f'beam-{BEAM}', jit]:.2f}x XLA {'on' if jit else 'off'}"
                     for jit in jits)
    print(f"summary: training tfdist/keras-hub {training} (target 1.2x); beam search {beam} "
          f"(target 2x); {time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
