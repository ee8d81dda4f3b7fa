"""Greedy and beam-search decoding with a key/value cache, usable under XLA.

Letters used for shapes:

    B  batch rows            K  beam size            L  max_length
    V  vocabulary            N  rows seen by step_fn (B, or B * K in beam search)

The model is a function `step_fn(ids, index, cache) -> (logits, new_cache)`:
`ids [N]` int32 is the token at position `index` (a scalar int32 tensor,
0-based; the BOS at index 0), `cache` a nested structure of tensors whose leading
dimension is N (e.g. keys/values `[N, heads, L, d_kv]` written at `index`, and
the encoder output, which never changes); it returns `logits [N, V]` for the
next token and a cache of the same structure and shapes.

Everything runs in one `tf.while_loop` with `maximum_iterations=L` over
fixed-shape state (ids are written into preallocated `[..., L]` buffers with a
one-hot mask), so both searches compile inside `tf.function(jit_compile=True)`.

Outputs exclude the BOS: position t holds the token chosen at step t; the EOS
is kept and everything after it is 0 (pad).

Beam search (after tensor2tensor's `beam_search.py`):

1. The K alive beams of a row accumulate log-softmax scores; at the start only
   beam 0 is live (the others score -inf), so no hypothesis is duplicated.
2. Each step takes the best 2K of the K * V continuations of a row; at most K
   of them end in EOS, so at least K do not.
3. Continuations ending in EOS that rank among the best K of those 2K join the
   finished set with score `log_prob / length_penalty(length, alpha)`, length
   counting the EOS; the finished set keeps its best K. (The rank condition, as
   in Hugging Face's `BeamSearchScorer`, makes `beam_size=1, alpha=0` exactly
   greedy search.)
4. The best K continuations not ending in EOS become the alive beams; every
   cache tensor is gathered by their parent beam.
5. The loop stops at L, or once no row can improve: for every row the best
   alive log-prob divided by `length_penalty(L, alpha)` (a bound on any
   hypothesis still to come, as log-probs only fall and the penalty is largest
   at L) is at most the worst of K finished scores (-inf while fewer than K).
6. Alive beams that reached L without EOS are candidates too, scored with the
   penalty at L; the best K candidates of each row are returned, best first.

With alpha > 0 and `beam_size=1`, a row whose greedy hypothesis has ended may
keep searching, since a longer hypothesis can have a better length-normalised
score; it then returns that hypothesis rather than greedy's.

Example:

```python
def step_fn(ids, index, cache):        # a "model" that predicts id + 1
    logits = 5.0 * tf.one_hot((ids + 1) % 4, 4) + cache["bias"]
    return logits, cache

cache = {"bias": tf.zeros([2, 4])}
ids, lengths = greedy_search(step_fn, tf.constant([0, 2]), cache, 4, eos_id=3)
# ids == [[1, 2, 3, 0], [3, 0, 0, 0]], lengths == [3, 1]
beams, scores = beam_search(step_fn, tf.constant([0, 2]), cache, 2, 4, eos_id=3)
# beams[:, 0] == ids; scores [2, 2], best first
```
"""

import numbers

import numpy as np
import tensorflow as tf

_NEG_INF = float("-inf")


def length_penalty(length, alpha):
    """GNMT length penalty `((5 + length) / 6) ** alpha`.

    Args:
        length: Number of tokens, EOS included; a number or a tensor.
        alpha: Exponent; 0 disables the penalty.

    Returns:
        A float32 tensor of the shape of `length`.
    """
    return ((5.0 + tf.cast(length, tf.float32)) / 6.0) ** alpha


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"`{name}` must be {kind}. Received: {name}={value!r}")


def _check_ids(initial_ids):
    initial_ids = tf.convert_to_tensor(initial_ids, tf.int32)
    if initial_ids.shape.rank is not None and initial_ids.shape.rank != 1:
        raise ValueError("`initial_ids` must be a vector [batch] of BOS ids. "
                         f"Received shape {initial_ids.shape}.")
    return initial_ids


def greedy_search(step_fn, initial_ids, cache, max_length, eos_id):
    """Decodes by taking the most likely token at every step.

    Args:
        step_fn: `(ids [B], index, cache) -> (logits [B, V], cache)`, see the module.
        initial_ids: int32 `[B]`, the BOS id of every row.
        cache: Nested structure of tensors with leading dimension B.
        max_length: Positive int, the most tokens generated per row.
        eos_id: Id of the end-of-sequence token.

    Returns:
        `(ids, lengths)`: int32 `[B, L]`, 0 after the EOS, and int32 `[B]`, the
        number of tokens including the EOS (L when a row has none).
    """
    _check_int("max_length", max_length, 1)
    _check_int("eos_id", eos_id, 0)
    initial_ids = _check_ids(initial_ids)
    batch = tf.shape(initial_ids)[0]

    def body(i, last, ids, lengths, done, cache):
        logits, cache = step_fn(last, i, cache)
        token = tf.where(done, 0, tf.argmax(logits, -1, output_type=tf.int32))
        ids += token[:, None] * tf.one_hot(i, max_length, dtype=tf.int32)[None, :]
        ends = tf.logical_and(tf.logical_not(done), tf.equal(token, eos_id))
        lengths = tf.where(ends, i + 1, lengths)
        return i + 1, token, ids, lengths, tf.logical_or(done, ends), cache

    state = (tf.constant(0), initial_ids, tf.zeros([batch, max_length], tf.int32),
             tf.fill([batch], tf.constant(max_length, tf.int32)),
             tf.zeros([batch], tf.bool), cache)
    _, _, ids, lengths, _, _ = tf.while_loop(
        lambda i, last, ids, lengths, done, cache: tf.logical_not(tf.reduce_all(done)),
        body, state, maximum_iterations=max_length)
    return ids, lengths


def beam_search(step_fn, initial_ids, cache, beam_size, max_length, eos_id, alpha=0.6):
    """Decodes with a beam of `beam_size` hypotheses per row (see the module).

    Args:
        step_fn: `(ids [B*K], index, cache) -> (logits [B*K, V], cache)`.
        initial_ids: int32 `[B]`, the BOS id of every row.
        cache: Nested structure of tensors with leading dimension B; each is
            tiled to `B * K` rows (row `b * K + k` is beam k of row b).
        beam_size: Positive int K.
        max_length: Positive int L, the most tokens generated per hypothesis.
        eos_id: Id of the end-of-sequence token.
        alpha: Length-penalty exponent >= 0 (0: plain log-probability).

    Returns:
        `(ids, scores)`: int32 `[B, K, L]` (0 after the EOS) and float32
        `[B, K]`, the length-normalised log-probabilities, best first; -inf
        where a row has fewer than K distinct hypotheses.
    """
    _check_int("beam_size", beam_size, 1)
    _check_int("max_length", max_length, 1)
    _check_int("eos_id", eos_id, 0)
    if (isinstance(alpha, bool) or not isinstance(alpha, numbers.Real)
            or not alpha >= 0):
        raise ValueError(f"`alpha` must be a number >= 0. Received: alpha={alpha!r}")
    initial_ids = _check_ids(initial_ids)
    k, length = beam_size, max_length
    batch = tf.shape(initial_ids)[0]
    cache = tf.nest.map_structure(lambda t: tf.repeat(t, k, axis=0), cache)
    max_penalty = length_penalty(length, alpha)
    in_top_k = tf.range(2 * k) < k  # [2K]: ranks allowed to finish

    def body(i, last, alive_seq, alive_logp, fin_seq, fin_scores, cache):
        logits, cache = step_fn(last, i, cache)                     # [B*K, V]
        vocab = tf.shape(logits)[-1]
        logp = tf.nn.log_softmax(tf.cast(logits, tf.float32))
        logp = alive_logp[:, :, None] + tf.reshape(logp, [batch, k, vocab])
        top_logp, top = tf.math.top_k(tf.reshape(logp, [batch, k * vocab]), 2 * k)
        parent, token = top // vocab, top % vocab                   # [B, 2K]
        seq = (tf.gather(alive_seq, parent, batch_dims=1)
               + token[:, :, None] * tf.one_hot(i, length, dtype=tf.int32))  # [B, 2K, L]
        is_eos = tf.equal(token, eos_id)

        alive_logp, keep = tf.math.top_k(tf.where(is_eos, _NEG_INF, top_logp), k)  # [B, K]
        alive_seq = tf.gather(seq, keep, batch_dims=1)
        rows = tf.gather(parent, keep, batch_dims=1) + k * tf.range(batch)[:, None]
        cache = tf.nest.map_structure(
            lambda t: tf.gather(t, tf.reshape(rows, [-1])), cache)
        last = tf.reshape(tf.gather(token, keep, batch_dims=1), [-1])

        new_scores = tf.where(tf.logical_and(is_eos, in_top_k),
                              top_logp / length_penalty(i + 1, alpha), _NEG_INF)
        fin_scores, best = tf.math.top_k(tf.concat([fin_scores, new_scores], 1), k)
        fin_seq = tf.gather(tf.concat([fin_seq, seq], 1), best, batch_dims=1)
        return i + 1, last, alive_seq, alive_logp, fin_seq, fin_scores, cache

    def can_improve(i, last, alive_seq, alive_logp, fin_seq, fin_scores, cache):
        return tf.reduce_any(alive_logp[:, 0] / max_penalty > fin_scores[:, -1])

    start_logp = tf.constant([[0.0] + [_NEG_INF] * (k - 1)])
    state = (tf.constant(0), tf.repeat(initial_ids, k),
             tf.zeros([batch, k, length], tf.int32), tf.tile(start_logp, [batch, 1]),
             tf.zeros([batch, k, length], tf.int32), tf.fill([batch, k], _NEG_INF),
             cache)
    i, _, alive_seq, alive_logp, fin_seq, fin_scores, _ = tf.while_loop(
        can_improve, body, state, maximum_iterations=length)

    # Alive hypotheses are complete only if they reached L (otherwise the
    # loop stopped because none of them could enter the finished set).
    alive_scores = tf.where(i >= length, alive_logp / max_penalty, _NEG_INF)
    scores, best = tf.math.top_k(tf.concat([fin_scores, alive_scores], 1), k)
    ids = tf.gather(tf.concat([fin_seq, alive_seq], 1), best, batch_dims=1)
    return ids, scores
