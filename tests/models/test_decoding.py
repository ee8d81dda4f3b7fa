"""Greedy and beam search against brute force over every sequence of a tiny model."""

import itertools

import numpy as np
import pytest
import tensorflow as tf

from tfdist.models.decoding import beam_search, greedy_search, length_penalty

VOCAB, EOS, D = 4, 3, 3


class TinyModel:
    """A recurrent "decoder" whose logits depend on the whole prefix through the cache.

    `state = tanh(state @ A + E[id] + sum(memory))`, `logits = state @ W + P[index]`;
    the cache holds `state [N, D]` (different per batch row) and an encoder
    `memory [N, 2, D]` that never changes.
    """

    def __init__(self, seed, batch=2, max_length=4, scale=1.5):
        rng = np.random.default_rng(seed)
        f32 = lambda *shape: (scale * rng.normal(size=shape)).astype(np.float32)
        self.a, self.e, self.w = f32(D, D), f32(VOCAB, D), f32(D, VOCAB)
        self.p = f32(max_length, VOCAB)
        self.state0, self.memory = f32(batch, D), f32(batch, 2, D)

    def cache(self):
        return {"state": tf.constant(self.state0),
                "encoder": {"memory": tf.constant(self.memory)}}

    def step_fn(self, ids, index, cache):
        memory = cache["encoder"]["memory"]
        state = tf.tanh(cache["state"] @ self.a + tf.gather(self.e, ids)
                        + tf.reduce_sum(memory, 1))
        logits = state @ self.w + tf.gather(self.p, index)
        return logits, {"state": state, "encoder": {"memory": memory}}

    def log_probs(self, row, prefix, bos):
        """float64 log-probabilities [V] of the token after BOS + prefix."""
        state = self.state0[row].astype(np.float64)
        for token in (bos,) + tuple(prefix):
            state = np.tanh(state @ self.a + self.e[token] + self.memory[row].sum(0))
        logits = state @ self.w + self.p[len(prefix)]
        return logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()

    def sequence_log_prob(self, row, seq, bos):
        return sum(self.log_probs(row, seq[:t], bos)[seq[t]] for t in range(len(seq)))


def _np_penalty(length, alpha):
    return ((5.0 + length) / 6.0) ** alpha


def _pad(seq, max_length):
    return tuple(seq) + (0,) * (max_length - len(seq))


def brute_force(model, row, bos, max_length, alpha):
    """Every hypothesis (ending at its first EOS, or at max_length), best first."""
    words = [t for t in range(VOCAB) if t != EOS]
    seqs = [p + (EOS,) for n in range(max_length)
            for p in itertools.product(words, repeat=n)]
    seqs += list(itertools.product(words, repeat=max_length))
    scored = [(model.sequence_log_prob(row, s, bos) / _np_penalty(len(s), alpha),
               _pad(s, max_length)) for s in seqs]
    return sorted(scored, key=lambda x: -x[0])


def np_greedy(model, row, bos, max_length):
    seq = []
    while len(seq) < max_length and (not seq or seq[-1] != EOS):
        seq.append(int(np.argmax(model.log_probs(row, seq, bos))))
    return _pad(seq, max_length), len(seq)


@pytest.mark.parametrize("alpha", [0.0, 0.6])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exhaustive_beam_equals_brute_force(seed, alpha):
    max_length = 4
    model = TinyModel(seed, max_length=max_length)
    bos = np.array([0, 2], np.int32)
    # 3**3 alive prefixes x 4 tokens = 108 candidates at the last step: all kept.
    beam = 108
    ids, scores = beam_search(model.step_fn, bos, model.cache(), beam, max_length,
                              EOS, alpha=alpha)
    assert ids.shape == (2, beam, max_length) and scores.shape == (2, beam)
    for row in range(2):
        expected = brute_force(model, row, int(bos[row]), max_length, alpha)
        np.testing.assert_allclose(scores[row], [s for s, _ in expected[:beam]],
                                   rtol=1e-5, atol=1e-5)
        assert [tuple(x) for x in ids[row, :10].numpy()] == [s for _, s in expected[:10]]
    # The two rows have different contexts, hence different best hypotheses' scores.
    assert abs(float(scores[0, 0]) - float(scores[1, 0])) > 1e-3


@pytest.mark.parametrize("seed", range(4))
def test_greedy_matches_numpy_reference(seed):
    model = TinyModel(seed, max_length=4)
    bos = np.array([1, 0], np.int32)
    ids, lengths = greedy_search(model.step_fn, bos, model.cache(), 4, EOS)
    for row in range(2):
        seq, n = np_greedy(model, row, int(bos[row]), 4)
        assert tuple(ids[row].numpy()) == seq and int(lengths[row]) == n


@pytest.mark.parametrize("seed", range(6))
def test_beam_size_one_is_greedy(seed):
    model = TinyModel(seed, max_length=4)
    bos = np.array([1, 2], np.int32)
    greedy_ids, lengths = greedy_search(model.step_fn, bos, model.cache(), 4, EOS)
    ids, scores = beam_search(model.step_fn, bos, model.cache(), 1, 4, EOS, alpha=0.0)
    np.testing.assert_array_equal(ids[:, 0], greedy_ids)
    # With a length penalty, beam 1 keeps its greedy hypothesis or finds a better one.
    _, scores_lp = beam_search(model.step_fn, bos, model.cache(), 1, 4, EOS, alpha=0.6)
    for row in range(2):
        seq = [t for t in greedy_ids[row].numpy()[: int(lengths[row])]]
        log_prob = model.sequence_log_prob(row, seq, int(bos[row]))
        np.testing.assert_allclose(scores[row, 0], log_prob, rtol=1e-5)
        assert scores_lp[row, 0] >= log_prob / _np_penalty(len(seq), 0.6) - 1e-5


def _fixed_step(first, later):
    """A step_fn with next-token probabilities `first` at index 0, `later` after."""
    first, later = np.log(first).astype(np.float32), np.log(later).astype(np.float32)

    def step_fn(ids, index, cache):
        logits = tf.where(tf.equal(index, 0), first, later)
        return tf.tile(logits[None], [tf.shape(ids)[0], 1]), cache
    return step_fn


def test_beam_size_one_only_finishes_eos_inside_the_beam():
    # [EOS] (0.4) beats greedy's [1, 1, 1, 1] (0.5 * 0.35**3), but it was never
    # in a beam of one: beam_size=1 must still return greedy's hypothesis.
    step_fn = _fixed_step([0.05, 0.5, 0.05, 0.4], [0.3, 0.35, 0.3, 0.05])
    bos, cache = tf.constant([0]), {"unused": tf.zeros([1, 1])}
    greedy_ids, _ = greedy_search(step_fn, bos, cache, 4, EOS)
    assert greedy_ids.numpy().tolist() == [[1, 1, 1, 1]]
    for alpha in (0.0, 0.6):
        ids, _ = beam_search(step_fn, bos, cache, 1, 4, EOS, alpha=alpha)
        assert ids.numpy().tolist() == [[[1, 1, 1, 1]]]


def test_length_penalty_lets_beam_one_outscore_greedy():
    # Greedy ends at once (EOS 0.30); [1, EOS] has log-prob log(.29 * .99) but a
    # better normalised score once alpha = 0.6.
    step_fn = _fixed_step([0.205, 0.29, 0.205, 0.30], [0.004, 0.003, 0.003, 0.99])
    bos, cache = tf.constant([0]), {"unused": tf.zeros([1, 1])}
    greedy_ids, _ = greedy_search(step_fn, bos, cache, 4, EOS)
    assert greedy_ids.numpy().tolist() == [[3, 0, 0, 0]]
    ids, _ = beam_search(step_fn, bos, cache, 1, 4, EOS, alpha=0.0)
    assert ids.numpy().tolist() == [[[3, 0, 0, 0]]]
    ids, scores = beam_search(step_fn, bos, cache, 1, 4, EOS, alpha=0.6)
    assert ids.numpy().tolist() == [[[1, 3, 0, 0]]]
    np.testing.assert_allclose(scores, [[np.log(0.29 * 0.99) / _np_penalty(2, 0.6)]],
                               rtol=1e-5)


def test_xla_and_graph_match_eager():
    model = TinyModel(3, batch=3, max_length=4)
    bos = tf.constant([0, 1, 2])

    def run(bos, cache):
        return (greedy_search(model.step_fn, bos, cache, 4, EOS),
                beam_search(model.step_fn, bos, cache, 3, 4, EOS, alpha=0.6))

    spec = {"state": tf.TensorSpec([None, D]),
            "encoder": {"memory": tf.TensorSpec([None, 2, D])}}
    graph = tf.function(run, input_signature=[tf.TensorSpec([None], tf.int32), spec])
    eager = run(bos, model.cache())
    for result in (tf.function(run, jit_compile=True)(bos, model.cache()),
                   graph(bos, model.cache())):
        (g_ids, g_len), (b_ids, b_scores) = result
        np.testing.assert_array_equal(g_ids, eager[0][0])
        np.testing.assert_array_equal(g_len, eager[0][1])
        np.testing.assert_array_equal(b_ids, eager[1][0])
        np.testing.assert_allclose(b_scores, eager[1][1], rtol=1e-5, atol=1e-6)


def _eos_step(counter):
    """Almost all mass on EOS at every step; counts its calls in `counter`."""
    def step_fn(ids, index, cache):
        counter.assign_add(1)
        return tf.tile(20.0 * tf.one_hot(EOS, VOCAB)[None], [tf.shape(ids)[0], 1]), cache
    return step_fn


@pytest.mark.parametrize("jit", [False, True])
def test_stops_early(jit):
    counter = tf.Variable(0)
    step_fn, bos = _eos_step(counter), tf.constant([0, 2])
    cache = {"unused": tf.zeros([2, 1])}
    greedy = lambda: greedy_search(step_fn, bos, cache, 10, EOS)
    beam = lambda: beam_search(step_fn, bos, cache, 2, 10, EOS, alpha=0.6)
    if jit:
        greedy, beam = tf.function(greedy, jit_compile=True), tf.function(beam, jit_compile=True)

    ids, lengths = greedy()
    assert int(counter.numpy()) == 1
    assert lengths.numpy().tolist() == [1, 1] and ids.numpy()[:, 0].tolist() == [EOS, EOS]
    assert not ids.numpy()[:, 1:].any()

    counter.assign(0)
    ids, scores = beam()
    # Step 0 finishes [EOS]; step 1 finishes [t, EOS] (log-prob ~ -20), which the
    # alive beams (~ -40 / penalty(10)) cannot beat: 2 steps instead of 10.
    assert int(counter.numpy()) == 2
    assert ids[:, 0, 0].numpy().tolist() == [EOS, EOS]
    assert ids[:, 1, 1].numpy().tolist() == [EOS, EOS]
    np.testing.assert_allclose(scores[:, 0], 0.0, atol=1e-6)
    np.testing.assert_allclose(scores[:, 1], -20.0 / _np_penalty(2, 0.6), rtol=1e-4)


def test_docstring_example():
    def step_fn(ids, index, cache):
        return 5.0 * tf.one_hot((ids + 1) % 4, 4) + cache["bias"], cache

    cache = {"bias": tf.zeros([2, 4])}
    ids, lengths = greedy_search(step_fn, tf.constant([0, 2]), cache, 4, eos_id=3)
    assert ids.numpy().tolist() == [[1, 2, 3, 0], [3, 0, 0, 0]]
    assert lengths.numpy().tolist() == [3, 1]
    beams, scores = beam_search(step_fn, tf.constant([0, 2]), cache, 2, 4, eos_id=3)
    np.testing.assert_array_equal(beams[:, 0], ids)
    assert np.all(np.diff(scores.numpy(), axis=1) <= 0)


def test_length_penalty_values():
    np.testing.assert_allclose(length_penalty(1, 0.6), 1.0)
    np.testing.assert_allclose(length_penalty(tf.constant([7, 13]), 0.5), [2 ** 0.5, 3 ** 0.5],
                               rtol=1e-6)
    np.testing.assert_allclose(length_penalty(40, 0.0), 1.0)


@pytest.mark.parametrize("kwargs, match", [
    ({"beam_size": 0}, "beam_size=0"),
    ({"beam_size": 2.0}, "beam_size=2.0"),
    ({"beam_size": True}, "beam_size=True"),
    ({"max_length": -1}, "max_length=-1"),
    ({"max_length": None}, "max_length=None"),
    ({"alpha": -0.1}, "alpha=-0.1"),
    ({"alpha": float("nan")}, "alpha=nan"),
    ({"alpha": "0.6"}, "alpha='0.6'"),
    ({"eos_id": -1}, "eos_id=-1"),
    ({"initial_ids": [[0, 1]]}, r"\[batch\].*\(1, 2\)"),
])
def test_bad_arguments(kwargs, match):
    args = dict(step_fn=_fixed_step([0.5, 0.5], [0.5, 0.5]), initial_ids=[0],
                cache={}, beam_size=2, max_length=3, eos_id=1, alpha=0.6)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        beam_search(**args)


def test_greedy_bad_arguments():
    with pytest.raises(ValueError, match="positive integer.*max_length=0"):
        greedy_search(_fixed_step([0.5, 0.5], [0.5, 0.5]), [0], {}, 0, 1)
