"""Attention over key blocks one chunk pair at a time, with an online softmax.

The kernel ring attention and Ulysses share (no collectives here). Queries
and keys are cut into equal chunks with global chunk ids; a (query chunk,
key chunk) pair is computed whole, on its diagonal (causal), or not at all
(causal, key chunk after the query chunk). A running maximum `m` and
denominator `l` per query row merge the blocks exactly (flash attention's
recurrence; ANCHORS B4):

    m' = max(m, rowmax(S))
    O  = O e^(m - m') + e^(S - m') V
    l  = l e^(m - m') + rowsum(e^(S - m'))

and the backward pass needs only the output and `lse = m + log l` per row
(recomputing each pair's probabilities):

    P  = e^(S - lse)          dV += P^T dO        dP = dO V^T
    dS = P (dP - rowsum(dO * O))   dQ += dS K scale     dK += dS^T Q scale

Letters: B batch, K key/value heads, G query heads per key head (H = K G),
Q query rows, S key rows, D d_kv. Queries `[B, K, G, Q, D]` (already scaled),
keys and values `[B, K, S, D]`, key validity `[B, S]` (1 valid, 0 padding).
Masked scores get -1e9 added per mask (padding and causal add up), as
`tfdist.layers.attention` does; a query row that sees no valid key gets a
finite output no loss should read.

Pairs run one after another (`Serial`): every pair's scores depend only on
its inputs, and TF's executor, free to order them, may compute the scores of
many pairs before the first merge consumes any, which makes the memory grow
with the square of the length; chained, at most one pair's scores are alive.
"""

from typing import List, Optional, Sequence

import tensorflow as tf

NEG_INF = -1e9


def chunk_pairs(q_ids: Sequence[int], k_ids: Sequence[int], causal: bool, window=None):
    """`(i, j, diagonal)` for query chunk `i` and key chunk `j` that see each other.

    Under `causal` a key chunk after the query chunk is skipped and the same
    chunk is masked on its diagonal; otherwise every pair is whole. `window`
    `(W, chunk)` (causal only): a key chunk whose every token is W or more
    positions before every query of the chunk is skipped too.
    """
    for i, qc in enumerate(q_ids):
        for j, kc in enumerate(k_ids):
            if window is not None and qc * window[1] - (kc * window[1] + window[1] - 1) \
                    >= window[0]:
                continue
            if not causal or kc < qc:
                yield i, j, False
            elif kc == qc:
                yield i, j, True


def split_rows(x, parts: int, axis: int) -> List:
    return tf.split(x, parts, axis=axis) if parts > 1 else [x]


def scores(q, k, key_valid: Optional[tf.Tensor], diagonal: bool, window=None):
    """`[B, K, G, Q, S]` scores of one chunk pair, masks added. `window`
    `(W, query chunk id, key chunk id, chunk)`: keys W or more positions before
    a query are masked (a sliding window)."""
    s = tf.einsum("bkgqd,bksd->bkgqs", q, k)
    if key_valid is not None:
        s += (1.0 - key_valid)[:, None, None, None, :] * NEG_INF
    if diagonal:
        allowed = tf.linalg.band_part(tf.ones([tf.shape(q)[3], tf.shape(k)[2]]), -1, 0)
        s += (1.0 - allowed) * NEG_INF
    if window is not None:
        w, qc, kc, chunk = window
        ahead = (qc * chunk + tf.range(chunk))[:, None] - (kc * chunk + tf.range(chunk))[None]
        s += tf.cast(ahead >= w, s.dtype) * NEG_INF
    return s


def _window_of(window, q_ids, k_ids, i, j):
    return None if window is None else (window[0], q_ids[i], k_ids[j], window[1])


class Serial:
    """A chain of pair computations: each begins after the previous one's results exist
    (a control dependency in a graph; eagerly, ops run in program order anyway)."""

    def __init__(self):
        self.last = None

    def after(self):
        """The context in which the next pair's first op is made."""
        return tf.control_dependencies([] if self.last is None else [self.last])

    def done(self, *results) -> None:
        self.last = tf.group(*results) if len(results) > 1 else results[0]


class OnlineSoftmax:
    """The running output, maximum and denominator of each query chunk."""

    def __init__(self, num_chunks: int):
        self.o: List = [None] * num_chunks
        self.m: List = [None] * num_chunks
        self.l: List = [None] * num_chunks
        self.serial = Serial()

    def add(self, i: int, s, v):
        """Merges scores `s` `[B, K, G, Q, S]` of values `v` `[B, K, S, D]` into chunk `i`."""
        m_block = tf.reduce_max(s, axis=-1)
        if self.m[i] is None:
            p = tf.exp(s - m_block[..., None])
            self.o[i] = tf.einsum("bkgqs,bksd->bkgqd", p, v)
            self.m[i], self.l[i] = m_block, tf.reduce_sum(p, axis=-1)
            return
        m_new = tf.maximum(self.m[i], m_block)
        alpha = tf.exp(self.m[i] - m_new)
        p = tf.exp(s - m_new[..., None])
        self.o[i] = self.o[i] * alpha[..., None] + tf.einsum("bkgqs,bksd->bkgqd", p, v)
        self.l[i] = self.l[i] * alpha + tf.reduce_sum(p, axis=-1)
        self.m[i] = m_new

    def finish(self, axis: int = 3):
        """`(out [B, K, G, Q, D], lse [B, K, G, Q])`, chunks concatenated on the rows."""
        out = tf.concat([o / l[..., None] for o, l in zip(self.o, self.l)], axis=axis)
        lse = tf.concat([m + tf.math.log(l) for m, l in zip(self.m, self.l)], axis=axis)
        return out, lse


def forward_block(state: OnlineSoftmax, q_chunks, q_ids, k, v, key_valid, k_ids, causal,
                  window=None):
    """Adds one key block (chunks `k_ids`) to `state` for the query chunks `q_ids`
    (`window`: `(W, chunk)`, a causal sliding window of W tokens)."""
    pairs = list(chunk_pairs(q_ids, k_ids, causal, window))
    if not pairs:
        return
    ks, vs = split_rows(k, len(k_ids), 2), split_rows(v, len(k_ids), 2)
    masks = split_rows(key_valid, len(k_ids), 1) if key_valid is not None else [None] * len(k_ids)
    for i, j, diagonal in pairs:
        with state.serial.after():
            s = scores(q_chunks[i], ks[j], masks[j], diagonal,
                       _window_of(window, q_ids, k_ids, i, j))
        state.add(i, s, vs[j])
        state.serial.done(state.o[i])


def backward_block(q_chunks, q_ids, dout_chunks, lse_chunks, delta_chunks, dq_chunks,
                   k, v, key_valid, k_ids, causal, scale, serial: Optional[Serial] = None,
                   window=None):
    """One key block's share of the gradients.

    Adds into `dq_chunks` (a list, per query chunk, updated in place) and
    returns `(dk, dv)` `[B, K, S, D]` of the block (zeros where no query saw it).
    `serial` chains the pairs across blocks (default: within this block).
    """
    serial = serial or Serial()
    pairs = list(chunk_pairs(q_ids, k_ids, causal, window))
    if not pairs:
        return tf.zeros_like(k), tf.zeros_like(v)
    ks, vs = split_rows(k, len(k_ids), 2), split_rows(v, len(k_ids), 2)
    masks = split_rows(key_valid, len(k_ids), 1) if key_valid is not None else [None] * len(k_ids)
    dks = [None] * len(k_ids)
    dvs = [None] * len(k_ids)
    for i, j, diagonal in pairs:
        with serial.after():
            p = tf.exp(scores(q_chunks[i], ks[j], masks[j], diagonal,
                              _window_of(window, q_ids, k_ids, i, j))
                       - lse_chunks[i][..., None])
            dp = tf.einsum("bkgqd,bksd->bkgqs", dout_chunks[i], vs[j])
        ds = p * (dp - delta_chunks[i][..., None])
        dq = tf.einsum("bkgqs,bksd->bkgqd", ds, ks[j]) * scale
        dk = tf.einsum("bkgqs,bkgqd->bksd", ds, q_chunks[i])  # q_chunks are scaled
        dv = tf.einsum("bkgqs,bkgqd->bksd", p, dout_chunks[i])
        dq_chunks[i] = dq if dq_chunks[i] is None else dq_chunks[i] + dq
        dks[j] = dk if dks[j] is None else dks[j] + dk
        dvs[j] = dv if dvs[j] is None else dvs[j] + dv
        serial.done(dq_chunks[i], dks[j], dvs[j])
    dks = [d if d is not None else tf.zeros_like(x) for d, x in zip(dks, ks)]
    dvs = [d if d is not None else tf.zeros_like(x) for d, x in zip(dvs, vs)]
    return tf.concat(dks, axis=2), tf.concat(dvs, axis=2)
