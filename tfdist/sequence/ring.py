"""Ring attention (pass-KV): key/value blocks travel around a mesh axis.

Each device keeps its own queries and, round after round, attends to the
key/value block it holds, merging blocks with an online softmax
(`blockwise`), then hands the block on. After `P - 1` hand-overs every
device has seen every block; only the local blocks, the output and the
per-row log-sum-exp are kept for the backward pass, which runs the ring
again carrying each block's key/value gradients with it and brings them home
with one last hand-over (Liu et al. 2023; Megatron-Core's context parallel).

The hand-overs are rounds of pair swaps on an even ring (odd-even
transposition: pairs (0 1)(2 3).., then (1 2)(3 0)..): every device sees
each block once in `P - 1` rounds and the `P`-th brings them home; a swap is
one send each way on every backend (`collectives.ppermute`). An odd ring
shifts by one instead.

Bytes per device: forward `(P - 1)` blocks of keys, values and key validity
(validity only with a key mask);
backward `(P - 1)` blocks of keys, values and validity, and `P - 1` of their
gradients (the owner's share stays home; the others' travel from the second
holder on, the last hand-over home). A block and its gradients travel as two
hand-overs, so the block need not wait for the previous round's compute.

Shapes: queries `[batch, length_q / P, heads, d_kv]`, keys and values
`[batch, length_k / P, kv_heads, d_kv]` (grouped queries: `heads` a multiple
of `kv_heads`), key validity `[batch, length_k / P]`.
"""

from typing import Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

from tfdist import collectives
from tfdist.sequence import blockwise
from tfdist.sequence.split import SequenceSplit

Permutation = Tuple[int, ...]


def ring_rounds(parts: int) -> List[Permutation]:
    """The `parts` hand-overs of a ring over `parts` devices (as `ppermute` sources).

    After the first `parts - 1` every device has held every block once; the
    last brings every block back to its owner.
    """
    rounds = []
    for t in range(parts):
        if parts % 2:
            rounds.append(tuple((k - 1) % parts for k in range(parts)))
            continue
        source = list(range(parts))
        for a in range(t % 2, parts + t % 2, 2):
            a, b = a % parts, (a + 1) % parts
            source[a], source[b] = b, a
        rounds.append(tuple(source))
    return rounds


def holders(parts: int, index: int) -> List[int]:
    """Which device's block device `index` holds before each of the `parts` computes."""
    held = list(range(parts))
    sequence = [held[index]]
    for source in ring_rounds(parts)[:-1]:
        held = [held[s] for s in source]
        sequence.append(held[index])
    return sequence


def check_shapes(q, k, v, key_mask, causal: bool) -> None:
    """One clear error for shapes the attention cannot take."""
    if q.shape.rank != 4 or k.shape.rank != 4 or v.shape.rank != 4:
        raise ValueError(
            "Sequence-parallel attention takes queries [batch, length, heads, d_kv] and keys / "
            f"values [batch, length, kv_heads, d_kv]; got shapes {q.shape}, {k.shape}, {v.shape}.")
    if k.shape != v.shape or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(f"Keys {k.shape} and values {v.shape} must have one shape, and its batch "
                         f"and d_kv must be the queries' {q.shape}.")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads do not group over {k.shape[2]} key/value "
                         "heads: the query heads must be a multiple of the key/value heads.")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"Causal attention needs queries and keys of one length; got "
                         f"{q.shape[1]} and {k.shape[1]} per device.")
    if key_mask is not None and tuple(key_mask.shape) != (k.shape[0], k.shape[1]):
        raise ValueError(f"key_mask must be [batch, length] of the keys {k.shape}; "
                         f"got {key_mask.shape}.")


def ring_attention(q, k, v, axis: Optional[str], *, causal: bool = False, key_mask=None,
                   balanced: bool = False, scale: Optional[float] = None,
                   block: Optional[int] = None, window: Optional[int] = None):
    """Dot-product attention over a sequence split along mesh axis `axis`.

    Args:
        q: `[batch, length_q / P, heads, d_kv]` this device's queries.
        k, v: `[batch, length_k / P, kv_heads, d_kv]` this device's keys, values.
        axis: the mesh axis the sequence is split over (None or size 1: one device).
        causal: hide later positions (queries and keys of one sequence).
        key_mask: `[batch, length_k / P]` 1 for a valid key, 0 for padding.
        balanced: the tokens were split in zig-zag chunks (`SequenceSplit`);
            only matters when `causal`.
        scale: the scores' factor (default `d_kv ** -0.5`).
        block: at most this many tokens per chunk (each device's chunks cut
            further): the largest score tensor is `[batch, heads, block,
            block]` and, when causal, blocks above the diagonal are skipped.
            On one device (`axis` None) this is flash attention's memory.
        window: with `causal`, a sliding window: a query sees the `window` keys
            ending at its own position (Mistral's and Qwen's; key chunks wholly
            outside it are skipped).

    Returns:
        `[batch, length_q / P, heads, d_kv]` in `q`'s dtype.
    """
    check_shapes(q, k, v, key_mask, causal)
    parts, index = collectives.axis_size(axis), collectives.axis_index(axis)
    if causal:
        split = SequenceSplit(int(q.shape[1]) * parts, parts, balanced)
        q_ids, k_ids_of = split.chunks(index), split.chunks
    else:
        q_ids, k_ids_of = (0,), (lambda j: (0,))
    if window is not None and not causal:
        raise ValueError(f"A sliding window (window={window}) needs causal=True.")
    return attend(q, k, v, key_mask, axis=axis, scale=scale, causal=causal, q_ids=q_ids,
                  k_ids_of=k_ids_of, index=index, parts=parts, block=block, window=window)


def pieces(length: int, block: Optional[int]) -> int:
    """Into how many equal pieces of at most `block` tokens `length` tokens cut."""
    if block is None or length <= block:
        return 1
    if block < 1:
        raise ValueError(f"The attention block must be a positive number of tokens; got {block}.")
    return next(n for n in range(-(-length // block), length + 1) if length % n == 0)


def attend(q, k, v, key_mask, *, axis, scale, causal, q_ids: Sequence[int],
           k_ids_of: Callable[[int], Sequence[int]], index: int, parts: int,
           block: Optional[int] = None, window: Optional[int] = None):
    """Blockwise attention of the local queries over the blocks of a ring of `parts`.

    `q_ids`: global chunk ids of the local queries' equal chunks;
    `k_ids_of(j)`: those of the key block device `j` starts with. With
    `parts == 1` there is no ring (Ulysses's local attention). `block`: each
    chunk cut into pieces of at most that many tokens (ids `chunk * n + i`,
    so causal order is kept).
    """
    n_q = pieces(int(q.shape[1]) // len(q_ids), block)
    n_k = n_q if causal else pieces(int(k.shape[1]) // len(k_ids_of(0)), block)
    if n_q > 1 or n_k > 1:
        q_ids = tuple(c * n_q + i for c in q_ids for i in range(n_q))
        chunk_ids_of = k_ids_of

        def k_ids_of(j):
            return tuple(c * n_k + i for c in chunk_ids_of(j) for i in range(n_k))

    # (W, tokens per chunk) of a sliding window
    window = None if window is None else (int(window), int(q.shape[1]) // len(q_ids))
    dtype = q.dtype
    b = tf.shape(q)[0]  # partial batches: unknown when traced
    lq, h, d = (int(n) for n in q.shape[1:])
    kv_heads, lk = int(k.shape[2]), int(k.shape[1])
    g = h // kv_heads
    scale = float(d) ** -0.5 if scale is None else float(scale)
    rounds = ring_rounds(parts) if parts > 1 else []
    held = holders(parts, index) if parts > 1 else [index]
    has_mask = key_mask is not None
    mask = tf.cast(key_mask, tf.float32) if has_mask else tf.zeros([0])  # nothing travels

    def to_blocks(x):  # [B, L, K, D] -> [B, K, L, D]
        return tf.transpose(tf.cast(x, tf.float32), [0, 2, 1, 3])

    def pack(*tensors):
        return tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)

    def unpack(flat, shapes):
        sizes = tf.stack([tf.reduce_prod(tf.stack(s)) for s in shapes])
        return [tf.reshape(p, s) for p, s in zip(tf.split(flat, sizes), shapes)]

    block_shape = [b, kv_heads, lk, d]
    shapes = [block_shape, block_shape] + ([[b, lk]] if has_mask else [])

    def hand_over(block, source):
        """Another device's keys, values and (with a key mask) validity; the empty
        stand-in for a missing mask stays here."""
        moved = unpack(collectives.ppermute(pack(*block[:len(shapes)]), axis, source), shapes)
        return moved + block[len(shapes):]

    @tf.custom_gradient
    def op(q, k, v, mask):
        qs = tf.reshape(tf.transpose(tf.cast(q, tf.float32), [0, 2, 1, 3]),
                        [b, kv_heads, g, lq, d]) * scale
        q_chunks = blockwise.split_rows(qs, len(q_ids), 3)
        kb, vb = to_blocks(k), to_blocks(v)
        state = blockwise.OnlineSoftmax(len(q_ids))
        block = [kb, vb, mask]
        for t in range(parts):
            if t:
                block = hand_over(block, rounds[t - 1])
            kt, vt, mt = block
            blockwise.forward_block(state, q_chunks, q_ids, kt, vt, mt if has_mask else None,
                                    k_ids_of(held[t]), causal, window)
        out, lse = state.finish()

        def grad(dout):
            do = tf.reshape(tf.transpose(tf.cast(dout, tf.float32), [0, 2, 1, 3]),
                            [b, kv_heads, g, lq, d])
            delta = tf.reduce_sum(do * out, axis=-1)
            do_chunks = blockwise.split_rows(do, len(q_ids), 3)
            lse_chunks = blockwise.split_rows(lse, len(q_ids), 3)
            delta_chunks = blockwise.split_rows(delta, len(q_ids), 3)
            dq_chunks = [None] * len(q_ids)
            # The block and the gradients that travel with it are handed over apart:
            # the block does not wait for the previous round's compute, and a round's
            # share of the gradients is computed before the previous holder's arrives.
            # The owner's own share stays home; the others' travel from the second
            # holder on and come home after the last round (P - 1 hand-overs).
            block = [kb, vb, mask]
            own = moving = None
            serial = blockwise.Serial()  # one pair after another, over every round
            for t in range(parts):
                if t:
                    block = hand_over(block, rounds[t - 1])
                kt, vt, mt = block
                share = blockwise.backward_block(
                    q_chunks, q_ids, do_chunks, lse_chunks, delta_chunks, dq_chunks, kt, vt,
                    mt if has_mask else None, k_ids_of(held[t]), causal, scale, serial,
                    window)
                if t == 0:
                    own = share
                elif t == 1:
                    moving = share
                else:
                    moved = unpack(collectives.ppermute(pack(*moving), axis, rounds[t - 1]),
                                   [block_shape, block_shape])
                    moving = (moved[0] + share[0], moved[1] + share[1])
            dk, dv = own
            if parts > 1:
                home = unpack(collectives.ppermute(pack(*moving), axis, rounds[-1]),
                              [block_shape, block_shape])
                dk, dv = dk + home[0], dv + home[1]
            dq = tf.concat([c if c is not None else tf.zeros_like(q_chunks[0])
                            for c in dq_chunks], axis=3)
            dq = tf.transpose(tf.reshape(dq, [b, h, lq, d]), [0, 2, 1, 3])
            dk = tf.transpose(dk, [0, 2, 1, 3])
            dv = tf.transpose(dv, [0, 2, 1, 3])
            return (tf.cast(dq, q.dtype), tf.cast(dk, k.dtype), tf.cast(dv, v.dtype),
                    tf.zeros_like(mask))

        result = tf.transpose(tf.reshape(out, [b, h, lq, d]), [0, 2, 1, 3])
        return tf.cast(result, dtype), grad

    return op(q, k, v, mask)
