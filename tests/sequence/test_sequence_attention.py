"""Ring and Ulysses attention over a split sequence equal dense attention on one device.

The reference is written here (float64, every key at once, TF's autodiff for
the gradients) and shares no code with tfdist.sequence: queries, keys and
values for the whole sequence go to every replica, each takes its own tokens
by the zig-zag / contiguous formula written below, runs the sequence-parallel
attention, and its output and gradients are compared with the reference's
rows at those positions.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfdist import collectives, sequence
from tfdist.strategies import MeshStrategy

TOL = dict(rtol=1e-5, atol=1e-5)


def _positions(length, parts, index, balanced):
    if balanced:
        c = length // (2 * parts)
        return np.r_[index * c:(index + 1) * c, (2 * parts - 1 - index) * c:(2 * parts - index) * c]
    c = length // parts
    return np.arange(index * c, (index + 1) * c)


def _reference(q, k, v, w, causal, key_mask, window=None):
    """Output and gradients of sum(attention(q, k, v) * w), float64, every key at once
    (`window`: keys `window` or more positions before a query masked too)."""
    q, k, v = (tf.constant(x, tf.float64) for x in (q, k, v))
    with tf.GradientTape() as tape:
        tape.watch([q, k, v])
        groups = q.shape[2] // k.shape[2]
        kk, vv = tf.repeat(k, groups, axis=2), tf.repeat(v, groups, axis=2)
        s = tf.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(q.shape[-1])
        if key_mask is not None:
            s += (1.0 - key_mask.astype("float64"))[:, None, None, :] * -1e9
        if causal:
            lq = q.shape[1]
            s += (1.0 - np.tril(np.ones((lq, lq))))[None, None] * -1e9
        if window is not None:
            ahead = np.arange(q.shape[1])[:, None] - np.arange(k.shape[1])[None]
            s += (ahead >= window)[None, None] * -1e9
        out = tf.einsum("bhqk,bkhd->bqhd", tf.nn.softmax(s, axis=-1), vv)
        loss = tf.reduce_sum(out * w)
    return [out.numpy()] + [g.numpy() for g in tape.gradient(loss, [q, k, v])]


def _data(batch, lq, lk, heads, kv_heads, d, padded, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, lq, heads, d)).astype("float32")
    k = rng.normal(size=(batch, lk, kv_heads, d)).astype("float32")
    v = rng.normal(size=(batch, lk, kv_heads, d)).astype("float32")
    w = rng.normal(size=(batch, lq, heads, d)).astype("float32")
    mask = None
    if padded:  # right padding, every row keeps its first key
        lengths = rng.integers(1, lk + 1, size=batch)
        lengths[0] = max(1, lk // 3)
        mask = (np.arange(lk)[None] < lengths[:, None]).astype("float32")
    return q, k, v, w, mask


_STRATEGIES = {}


def _strategy(mesh):
    if mesh not in _STRATEGIES:
        _STRATEGIES[mesh] = MeshStrategy(mesh)
    return _STRATEGIES[mesh]


def _run(mesh, method, q, k, v, w, mask, causal, balanced, block=None, window=None):
    strategy = _strategy(mesh)
    data_size = strategy.mesh.shape.axis_size("data") if "data" in mesh else 1
    parts = strategy.mesh.shape.axis_size("seq")
    lq, lk, batch = q.shape[1], k.shape[1], q.shape[0]
    rows = batch // data_size

    @tf.function
    def step():
        def replica_fn():
            index, data = collectives.axis_index("seq"), collectives.axis_index("data")
            pos_q = _positions(lq, parts, index, balanced)
            pos_k = _positions(lk, parts, index, balanced)
            batch_rows = slice(data * rows, (data + 1) * rows)
            ql, kl, vl = (tf.constant(x[batch_rows][:, p])
                          for x, p in ((q, pos_q), (k, pos_k), (v, pos_k)))
            wl = tf.constant(w[batch_rows][:, pos_q])
            ml = None if mask is None else tf.constant(mask[batch_rows][:, pos_k])
            with tf.GradientTape() as tape:
                tape.watch([ql, kl, vl])
                out = sequence.sequence_attention(ql, kl, vl, "seq", method=method,
                                                  causal=causal, key_mask=ml, balanced=balanced,
                                                  block=block, window=window)
                loss = tf.reduce_sum(out * wl)
            return [out] + tape.gradient(loss, [ql, kl, vl])

        return strategy.run(replica_fn)

    results = step()
    per_replica = [strategy.experimental_local_results(r) for r in results]
    return [[t.numpy() for t in values] for values in per_replica]


CASES = [
    # mesh, method, causal, balanced, padded, (batch, lq, lk, heads, kv_heads, d)
    ("seq:2", "ring", True, True, True, (2, 16, 16, 4, 2, 8)),
    ("seq:4", "ring", True, True, True, (2, 16, 16, 4, 4, 8)),
    ("seq:4", "ring", True, False, False, (2, 16, 16, 2, 1, 8)),
    ("seq:3", "ring", True, True, True, (2, 12, 12, 2, 2, 4)),
    ("seq:4", "ring", False, False, True, (2, 8, 16, 4, 2, 8)),
    ("seq:2", "ulysses", True, True, True, (2, 16, 16, 4, 2, 8)),
    ("seq:4", "ulysses", True, True, False, (2, 16, 16, 8, 2, 8)),
    ("seq:2", "ulysses", False, False, True, (2, 8, 12, 2, 1, 8)),
    ("data:2;seq:2", "ring", True, True, True, (4, 8, 8, 2, 1, 8)),
    ("data:2;seq:2", "ulysses", False, False, True, (4, 8, 8, 4, 4, 8)),
]


@pytest.mark.parametrize("mesh, method, causal, balanced, padded, dims", CASES,
                         ids=[f"{c[0]}-{c[1]}-{'causal' if c[2] else 'full'}"
                              f"{'-zigzag' if c[3] else ''}{'-padded' if c[4] else ''}"
                              f"-h{c[5][3]}kv{c[5][4]}" for c in CASES])
def test_equals_dense_attention(mesh, method, causal, balanced, padded, dims):
    batch, lq, lk, heads, kv_heads, d = dims
    q, k, v, w, mask = _data(batch, lq, lk, heads, kv_heads, d, padded)
    want = _reference(q, k, v, w, causal, mask)
    strategy = _strategy(mesh)
    parts = strategy.mesh.shape.axis_size("seq")
    data_size = strategy.mesh.shape.axis_size("data") if "data" in mesh else 1
    got = _run(mesh, method, q, k, v, w, mask, causal, balanced)
    rows = batch // data_size
    for replica in range(strategy.num_replicas_in_sync):
        data, index = divmod(replica, parts)
        batch_rows = slice(data * rows, (data + 1) * rows)
        pos_q = _positions(lq, parts, index, balanced)
        pos_k = _positions(lk, parts, index, balanced)
        for name, value, ref, pos in zip(["out", "dq", "dk", "dv"], got, want,
                                         [pos_q, pos_q, pos_k, pos_k]):
            np.testing.assert_allclose(value[replica], ref[batch_rows][:, pos], **TOL,
                                       err_msg=f"{name} of replica {replica}")


@pytest.mark.parametrize("mesh, method, causal", [
    ("seq:2", "ring", True), ("seq:2", "ulysses", True), ("seq:2", "ring", False)])
def test_blocks_within_each_device_equal_dense_attention(mesh, method, causal):
    """block=2: each device's zig-zag chunks of 4 tokens cut in two (causal blocks above the
    diagonal skipped within a chunk pair too)."""
    q, k, v, w, mask = _data(2, 16, 16, 4, 2, 8, padded=True)
    want = _reference(q, k, v, w, causal, mask)
    got = _run(mesh, method, q, k, v, w, mask, causal, True, block=2)
    for replica in range(2):
        pos = _positions(16, 2, replica, True)
        for name, value, ref in zip(["out", "dq", "dk", "dv"], got, want):
            np.testing.assert_allclose(value[replica], ref[:, pos], **TOL, err_msg=name)


@pytest.mark.parametrize("mesh, method, window, block", [
    ("seq:2", "ring", 3, None), ("seq:2", "ulysses", 5, None), ("seq:4", "ring", 4, None),
    ("seq:2", "ring", 6, 2)])
def test_a_sliding_window_equals_dense_windowed_attention(mesh, method, window, block):
    """Causal, zig-zag, padded: keys `window` or more positions back are masked, key
    chunks wholly outside the window skipped (seq:4 windows of 4 over chunks of 2 skip
    most of them); outputs and gradients equal dense attention with the same mask."""
    q, k, v, w, mask = _data(2, 16, 16, 4, 2, 8, padded=True)
    # A query whose window holds only padding sees no valid key: its output is finite but
    # not the dense softmax's (which spreads it over keys the window masks as much); no
    # loss reads it, so it gets no weight here and its output is not compared.
    positions = np.arange(16)
    in_window = (positions[:, None] - positions[None] >= 0) & \
        (positions[:, None] - positions[None] < window)
    seen = (in_window[None] & (mask[:, None, :] > 0)).any(-1)  # [batch, query]
    w = w * seen[:, :, None, None]
    want = _reference(q, k, v, w, True, mask, window=window)
    assert not np.allclose(want[0], _reference(q, k, v, w, True, mask)[0])  # the window acts
    parts = _strategy(mesh).mesh.shape.axis_size("seq")
    got = _run(mesh, method, q, k, v, w, mask, True, True, block=block, window=window)
    for replica in range(parts):
        pos = _positions(16, parts, replica, True)
        for name, value, ref in zip(["out", "dq", "dk", "dv"], got, want):
            if name == "out":
                value, ref = value[replica] * seen[:, pos, None, None], ref * seen[:, :, None, None]
            else:
                value = value[replica]
            np.testing.assert_allclose(value, ref[:, pos], **TOL, err_msg=name)


def test_a_window_without_causal_is_refused():
    x = tf.zeros([1, 4, 2, 4])
    with pytest.raises(ValueError, match=r"A sliding window \(window=2\) needs causal=True"):
        sequence.ring_attention(x, x, x, None, window=2)


@pytest.mark.parametrize("causal, block", [(True, 4), (True, 5), (False, 3)])
def test_blockwise_attention_on_one_device_equals_dense_attention(causal, block):
    """axis None: flash attention's blocks on one device (block 5 of 16 tokens: 4 pieces)."""
    q, k, v, w, mask = _data(2, 16, 16, 4, 2, 8, padded=True)
    want = _reference(q, k, v, w, causal, mask)
    qt, kt, vt = (tf.constant(x) for x in (q, k, v))
    with tf.GradientTape() as tape:
        tape.watch([qt, kt, vt])
        out = sequence.ring_attention(qt, kt, vt, None, causal=causal, key_mask=mask,
                                      block=block)
        loss = tf.reduce_sum(out * w)
    got = [out] + tape.gradient(loss, [qt, kt, vt])
    for name, value, ref in zip(["out", "dq", "dk", "dv"], got, want):
        np.testing.assert_allclose(value.numpy(), ref, **TOL, err_msg=name)


def test_block_pairs_run_one_after_another():
    """Each chunk pair's scores are made after the previous pair's results (forward and
    backward): left free, TF's executor may compute every pair's scores before merging
    any, and memory grows with the square of the length (measured: 1358 MiB against
    286 MiB chained, one process at 8192 tokens, bench/long_context.py's model)."""
    q, k, v, w, mask = _data(1, 16, 16, 2, 2, 8, padded=True)

    @tf.function
    def step(q, k, v):
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            out = sequence.ring_attention(q, k, v, None, causal=True, key_mask=mask, block=4)
            loss = tf.reduce_sum(out * w)
        return tape.gradient(loss, [q, k, v])

    graph = step.get_concrete_function(*(tf.constant(x) for x in (q, k, v))).graph
    scores = [op for op in graph.get_operations()
              if op.type == "Einsum" and op.get_attr("equation") == b"bkgqd,bksd->bkgqs"]
    # 4 chunks of 4, causal: 10 pairs' scores forward; backward their scores and dP again
    assert len(scores) == 30
    free = [op for op in scores if not op.control_inputs]
    assert len(free) == 3  # the first pair's forward scores, backward scores and dP


def test_ring_moves_one_block_per_pair_swap():
    """seq:4, causal: the forward pass hands over 3 blocks (keys, values, validity) and the
    backward 3 blocks and 3 times their gradients (the last home): each a two-device gather
    of exactly one block, no other collective."""
    strategy = _strategy("seq:4")
    b, l, h, d = 2, 16, 2, 8
    q, k, v, w, mask = _data(b, l, l, h, h, d, padded=True)

    @tf.function
    def step():
        def replica_fn():
            index = collectives.axis_index("seq")
            pos = _positions(l, 4, index, True)
            ql, kl, vl = (tf.constant(x[:, pos]) for x in (q, k, v))
            with tf.GradientTape() as tape:
                tape.watch([ql, kl, vl])
                out = sequence.ring_attention(ql, kl, vl, "seq", causal=True, balanced=True,
                                              key_mask=tf.constant(mask[:, pos]))
                loss = tf.reduce_sum(out * w[:, pos])
            return tape.gradient(loss, [ql, kl, vl])

        return strategy.run(replica_fn)

    ops = [op for op in step.get_concrete_function().graph.get_operations()
           if op.type.startswith("Collective")]
    block = b * h * (l // 4) * d
    validity = b * (l // 4)
    keys_values, gradients = 2 * block + validity, 2 * block
    assert {op.type for op in ops} == {"CollectiveGatherV2"}
    assert {int(op.inputs[1].op.get_attr("value").int_val[0]) for op in ops} == {2}  # group size
    sizes = sorted(int(np.prod(op.inputs[0].shape)) for op in ops)
    assert sizes == sorted([keys_values] * (3 + 3) * 4 + [gradients] * 3 * 4)


def test_ring_schedule_visits_every_block_once_and_returns_home():
    for parts in range(1, 9):
        rounds = sequence.ring_rounds(parts)
        assert len(rounds) == parts
        held = list(range(parts))
        seen = [[k] for k in range(parts)]
        for t, source in enumerate(rounds):
            assert sorted(source) == list(range(parts))
            if parts % 2 == 0:  # pair swaps: one send each way
                assert all(source[source[j]] == j for j in range(parts))
            held = [held[s] for s in source]
            if t < parts - 1:
                for j in range(parts):
                    seen[j].append(held[j])
        assert held == list(range(parts))
        assert all(sorted(s) == list(range(parts)) for s in seen)


def test_split_positions_and_errors():
    split = sequence.SequenceSplit(8, 2, balanced=True)
    np.testing.assert_array_equal(split.positions(0), [0, 1, 6, 7])
    np.testing.assert_array_equal(split.positions(1), [2, 3, 4, 5])
    np.testing.assert_array_equal(sequence.SequenceSplit(8, 4).positions(2), [4, 5])
    with pytest.raises(ValueError, match=r"length 10 does not split into 2 x 2 zig-zag.*multiple of 4.*12"):
        sequence.SequenceSplit(10, 2, balanced=True)


def test_ulysses_refuses_heads_that_do_not_divide():
    strategy = _strategy("seq:4")
    x = tf.zeros([1, 2, 6, 4])

    def replica_fn():
        return sequence.ulysses_attention(x, x, x, "seq")

    with pytest.raises(ValueError, match=r"6 query heads over the 4 devices of mesh axis 'seq'"):
        strategy.run(tf.function(replica_fn))


def test_local_and_global_tokens_round_trip():
    strategy = _strategy("seq:4")
    x = np.arange(2 * 16 * 3, dtype="float32").reshape(2, 16, 3)

    @tf.function
    def step():
        def replica_fn():
            local = sequence.local_tokens(tf.constant(x), "seq", balanced=True)
            return local, sequence.global_tokens(local, "seq", balanced=True), \
                sequence.local_positions(16, "seq", balanced=True)

        return strategy.run(replica_fn)

    local, whole, positions = (strategy.experimental_local_results(t) for t in step())
    for r in range(4):
        pos = _positions(16, 4, r, True)
        np.testing.assert_array_equal(local[r].numpy(), x[:, pos])
        np.testing.assert_array_equal(whole[r].numpy(), x)
        np.testing.assert_array_equal(positions[r].numpy(), pos)
