"""Translating text, BLEU, and the Keras pieces that report them during `fit`.

`NMTEvaluation` runs at the end of every epoch (one epoch = `eval_every`
steps in scripts/train_nmt.py): it turns the epoch's `tokens` metric into
`tokens_per_second`, translates held-out sentences with beam search and adds
`bleu` (sacrebleu, corpus level) to the epoch logs, where a `TensorBoard`
callback placed after it writes them as scalars.
"""

import time
from typing import List, Sequence

import keras
import numpy as np
import tensorflow as tf


def translate_texts(model, tokenizer, sources: Sequence[str], batch_size: int = 64,
                    beam_size: int = 4, alpha: float = 0.6, max_length: int = None) -> List[str]:
    """Translations of `sources` (strings) by `model.translate`, in order."""
    from tfdist.data.nmt import make_eval_batches

    max_length = max_length or model.model_config.max_length
    batches, count = make_eval_batches(list(sources), tokenizer, batch_size, max_length)
    out = []
    for batch in batches:
        ids = model.translate(batch, beam_size=beam_size, alpha=alpha, max_length=max_length)
        out.extend(tokenizer.decode_batch(np.asarray(ids).tolist()))
    return out[:count]


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str],
                tokenize: str = "13a") -> float:
    """sacrebleu's corpus BLEU of `hypotheses` against one reference each.

    `tokenize="13a"` is the WMT standard; `"char"` scores characters, for
    languages that write compounds as one word (German number words are one
    word each, so word BLEU only counts exact sentences and no 2-grams exist).
    """
    import sacrebleu

    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)],
                                       tokenize=tokenize).score)


def exact_match(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Fraction of hypotheses equal to their reference (after stripping spaces at the ends)."""
    pairs = list(zip(hypotheses, references))
    return sum(h.strip() == r.strip() for h, r in pairs) / max(len(pairs), 1)


@keras.saving.register_keras_serializable(package="tfdist")
class TokenCount(keras.metrics.Metric):
    """Real (non-padding) target tokens seen since the last reset (all replicas)."""

    def __init__(self, name="tokens", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable(shape=(), initializer="zeros", name="total",
                                       aggregation="sum")

    def update_state(self, y_true, y_pred=None, sample_weight=None):
        self.total.assign_add(tf.reduce_sum(tf.cast(tf.not_equal(y_true, 0), self.dtype)))

    def result(self):
        return tf.identity(self.total)

    def reset_state(self):
        self.total.assign(0.0)


class NMTEvaluation(keras.callbacks.Callback):
    """Adds `tokens_per_second` and held-out `bleu` to each epoch's logs.

    Args:
        tokenizer: a `tfdist.data.nmt.Tokenizer`.
        pairs: held-out `(source, reference)` pairs.
        beam_size, alpha: decoding.
        examples: translations to print after each evaluation.
        batch_size: sentences per decoding batch.
        tokenize: sacrebleu tokenisation ("13a", or "char" for compounding languages).
    """

    def __init__(self, tokenizer, pairs, beam_size=4, alpha=0.6, examples=3, batch_size=64,
                 tokenize="13a"):
        super().__init__()
        self.tokenize = tokenize
        self.tokenizer, self.pairs = tokenizer, list(pairs)
        self.beam_size, self.alpha = beam_size, alpha
        self.examples, self.batch_size = examples, batch_size
        self.history = []
        self._start = None

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def evaluate(self):
        """`(bleu, hypotheses)` on the held-out pairs."""
        hypotheses = translate_texts(self.model, self.tokenizer, [s for s, _ in self.pairs],
                                     self.batch_size, self.beam_size, self.alpha)
        return corpus_bleu(hypotheses, [r for _, r in self.pairs], self.tokenize), hypotheses

    def on_epoch_end(self, epoch, logs=None):
        logs = logs if logs is not None else {}
        elapsed = time.perf_counter() - self._start
        if "tokens" in logs:
            logs["tokens_per_second"] = float(logs["tokens"]) / elapsed
        bleu, hypotheses = self.evaluate()
        logs["bleu"] = bleu
        logs["exact_match"] = exact_match(hypotheses, [r for _, r in self.pairs])
        self.history.append(bleu)
        lines = [f"epoch {epoch + 1}: held-out BLEU {bleu:.1f} ({self.tokenize}), exact "
                 f"{logs['exact_match']:.0%} on {len(self.pairs)} sentences"
                 + (f", {logs['tokens_per_second']:.0f} target tokens/s"
                    if "tokens_per_second" in logs else "")]
        for (source, reference), hypothesis in list(zip(self.pairs, hypotheses))[:self.examples]:
            lines.append(f"  {source}  ->  {hypothesis}   (reference: {reference})")
        print("\n".join(lines), flush=True)
