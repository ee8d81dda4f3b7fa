"""tfdist's NMT Transformer with `length` split over a mesh axis trains like one device.

Source and target sequences are both split (zig-zag, `split_sequences`): the
encoder's self-attention and the decoder's causal self-attention run over the
split sequence (ring or Ulysses), the decoder's cross-attention attends from
its tokens over the encoder's split memory, positions are global (learned
positions read their rows of the table), and the loss is the mean over the
global batch's real tokens. The reference is the same model on one device
(dense softmax attention over whole sequences, sliced positions): forward
loss, gradients, and weights and Adam slots after 10 steps must agree.
"""

import dataclasses

import keras
import numpy as np
import pytest

from tfdist.models.transformer import SequenceCrossentropy, Transformer
from tfdist.models.transformer_layers import TransformerConfig
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import assert_equivalent, compare_with_reference, run_reference
from tfdist.testing.pipeline import relative

V, BATCH, LENGTH, STEPS = 32, 4, 8, 10


def _config(method="ring"):
    # Learned positions and untied embeddings: the position table's gradient and both
    # tables' rows come from every device's tokens.
    return TransformerConfig(vocab_size=V, d_model=16, num_heads=4, d_kv=4, d_ff=32,
                             num_encoder_layers=1, num_decoder_layers=1, max_length=LENGTH,
                             dropout=0.0, positions="learned", share_embeddings=False,
                             sequence_method=method)


def _pairs(rows, seed=5):
    """Right-padded source / target pairs of LENGTH tokens (BOS + target as the
    decoder's input)."""
    rng = np.random.default_rng(seed)
    src = rng.integers(3, V, size=(rows, LENGTH)).astype("int32")
    tgt = rng.integers(3, V, size=(rows, LENGTH)).astype("int32")
    for i in range(rows):
        src[i, rng.integers(2, LENGTH + 1):] = 0
        cut = rng.integers(1, LENGTH)
        tgt[i, cut] = 2
        tgt[i, cut + 1:] = 0
    decoder_input = np.concatenate([np.ones((rows, 1), "int32"), tgt[:, :-1]], axis=1)
    decoder_input[decoder_input == 2] = 0
    return (src, decoder_input), tgt


ARGS = dict(loss=SequenceCrossentropy(V, label_smoothing=0.1),
            optimizer=lambda: keras.optimizers.Adam(1e-2), batch_size=BATCH, steps=STEPS)


@pytest.fixture(scope="module")
def data():
    return _pairs(BATCH * STEPS)


@pytest.fixture(scope="module")
def reference(data):
    x, y = data
    config = _config()
    return run_reference(lambda: Transformer(config), x, y, compare_outputs=False,
                         reference=lambda: Transformer(config), **ARGS)


@pytest.mark.parametrize("mesh, layout, method", [
    ("seq:2", "length:seq", "ring"),
    ("seq:4", "length:seq", "ring"),
    ("data:2;seq:2", "batch:data;length:seq", "ulysses"),
    # Length x model: ring attention over each device's heads, Megatron's exchanges
    # over the model axis, the vocabulary split (tables and softmax).
    ("seq:2;model:2", "length:seq;heads:model;d_ff:model;vocab:model", "ring"),
    # seq:2;model:2 with Ulysses: the MoE Transformer's test below (heads and vocabulary on
    # model; experts there instead of d_ff, which the ring case covers).
    # Megatron sequence parallelism: length and heads on one axis; the model axis's
    # devices hold the same rows, different tokens, and the attention core regroups the
    # gathered token blocks into whole sequences.
    ("model:2", "length:model;heads:model;d_ff:model;vocab:model", "ring"),
    ("data:2;model:2", "batch:data;length:model;heads:model;d_ff:model;vocab:model", "ring"),
])
def test_a_sequence_split_transformer_trains_like_one_device(data, reference, mesh, layout,
                                                             method):
    x, y = data
    config = _config(method)
    report = assert_equivalent(
        lambda: Transformer(config), MeshStrategy(mesh, layout), x, y, compare_outputs=False,
        reference=lambda: Transformer(_config()), reference_run=reference, rtol=1e-5, **ARGS)
    print(f"transformer {mesh} {layout} {method}: {report}")


def test_learned_positions_get_a_dense_gradient_on_a_split_sequence():
    # Keras's Adam squares IndexedSlices values before adding duplicate rows; the
    # position rows of P devices would be P duplicates of every row of one device's
    # dense slice gradient. The sequence path reads the table with a dense gradient.
    import tensorflow as tf

    from tfdist.models.transformer import gather_rows_dense_gradient

    table = tf.Variable(tf.random.normal([8, 3]))
    positions = tf.constant([0, 1, 6, 7, 0], tf.int32)
    with tf.GradientTape() as tape:
        rows = gather_rows_dense_gradient(table, positions)
        loss = tf.reduce_sum(rows * tf.range(5.0)[:, None])
    gradient = tape.gradient(loss, table)
    assert isinstance(gradient, tf.Tensor)  # not IndexedSlices
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(table, positions) * tf.range(5.0)[:, None])
    np.testing.assert_allclose(gradient.numpy(),
                               tf.convert_to_tensor(tape.gradient(loss, table)).numpy())


def _moe_config(method):
    # An MoE in the second block of the encoder and of the decoder; groups of 2 tokens
    # (the zig-zag chunks of 8 tokens over 2 devices hold 2) and capacity 1: tokens are
    # dropped, so groups that differed from one device's would change the result.
    return dataclasses.replace(_config(method), num_encoder_layers=2, num_decoder_layers=2,
                               moe_experts=4, moe_top_k=2, moe_group_size=2,
                               moe_capacity_factor=1.0)


@pytest.fixture(scope="module")
def moe_reference(data):
    x, y = data
    return run_reference(lambda: Transformer(_moe_config("ring")), x, y, compare_outputs=False,
                         reference=lambda: Transformer(_moe_config("ring")), **ARGS)


@pytest.mark.parametrize("mesh, layout, method", [
    ("seq:2", "length:seq", "ring"),
    # Experts split over the model axis (all-to-all dispatch) beside the length split.
    ("seq:2;model:2", "length:seq;experts:model;heads:model;vocab:model", "ulysses"),
])
def test_an_moe_transformer_over_a_split_sequence_trains_like_one_device(data, moe_reference,
                                                                         mesh, layout, method):
    x, y = data
    report = compare_with_reference(
        lambda: Transformer(_moe_config(method)), MeshStrategy(mesh, layout), x, y,
        compare_outputs=False, reference=lambda: Transformer(_moe_config("ring")),
        reference_run=moe_reference, **ARGS)
    assert max(report.loss, report.added_losses, report.gradients,
               report.optimizer_variables) <= 1e-5, report
    # The weights after 10 steps by the measure, the relative L2 over all of them
    # (2e-7 on seq:2). The largest difference of one tensor relative to its own largest
    # value reached 1.1e-5 (decoder_1's cross-attention keys): Adam divides each update
    # by the root of its second moment, so float32 rounding in a small gradient (ring
    # blocks add in another order than one device's softmax) moves its weight as much
    # as a large one's.
    l2 = float(relative(np.concatenate([w.ravel() for w in report.model.get_weights()]),
                        np.concatenate([w.ravel() for w in moe_reference.weights])))
    assert l2 <= 1e-5 and report.weights <= 1e-4, (l2, report)
    print(f"MoE transformer {mesh} {layout} {method}: {report}; weights relative L2 {l2:.1e}")


def test_moe_groups_that_cross_a_zig_zag_chunk_are_refused():
    config = _moe_config("ring")
    with pytest.raises(ValueError, match=r"moe_group_size=2 does not divide the 1 tokens of a "
                                         r"zig-zag chunk.*'seq'"):
        config.check_sequence_split(4, "seq")  # 8 tokens over 2 x 4 chunks
    # The layer refuses it too where a model is built without the config's check.
    from tfdist.layers import MoE

    strategy = MeshStrategy("seq:2", "length:seq")
    with strategy.scope():
        layer = MoE(4, 8, group_size=4, name="moe")
        layer.build((None, None, 8))
    x = np.zeros((2, 4, 8), "float32")  # local: 2 chunks of 2 tokens per row
    with pytest.raises(ValueError, match=r"group_size=4 does not divide the 2 tokens of a "
                                         r"zig-zag chunk \(length 8 over the 2 devices"):
        strategy.run(lambda: layer(x, training=True))


# (seq:2 ring alone: the seq:2;model:2 case runs the ring with padded rows and an MoE.)
@pytest.mark.parametrize("mesh, layout, method, moe", [
    ("data:2;seq:2", "batch:data;length:seq", "ulysses", False),
    # An MoE in the encoder's second block: sources pad to a multiple of 2 P x group size.
    ("seq:2;model:2", "length:seq;heads:model;d_ff:model;vocab:model;experts:model", "ring",
     True),
    # Megatron sequence parallelism: the attention core regroups the gathered tokens.
    ("model:2", "length:model;heads:model;d_ff:model;vocab:model", "ring", False),
])
def test_beam_search_encodes_the_source_over_the_split_sequence(monkeypatch, mesh, layout,
                                                                method, moe):
    """`translate` on a mesh splitting `length` runs the encoder over the split (the
    attention over the sequence axis, every device on its share) and decodes what one
    device decodes: the same memory and the same beams."""
    import tensorflow as tf

    from tfdist import sequence

    config = dataclasses.replace(_moe_config(method) if moe else _config(method),
                                 num_decoder_layers=2)
    strategy = MeshStrategy(mesh, layout)
    with strategy.scope():
        model = Transformer(config)
    keras.utils.set_random_seed(7)
    plain = Transformer(config)
    # A larger initial scale than Keras's: random models' logits otherwise nearly tie.
    model.set_weights([3 * w if w.ndim > 1 else w for w in plain.get_weights()])
    plain.set_weights(model.get_weights())
    # 3 rows of 7 tokens: rows pad to the row groups, tokens to 2 P (x group size).
    (src, _), _ = _pairs(3, seed=11)
    src = src[:, :7]
    split_calls = []
    if mesh == "model:2":
        from tfdist.layers.attention import ShardedAttention

        attend_gathered = ShardedAttention._attend_gathered_tokens

        def spy_gathered(self, q, k, v, axis, *args):
            split_calls.append((axis, int(q.shape[2])))  # q: [b M, H / M, L / M, d_kv]
            return attend_gathered(self, q, k, v, axis, *args)

        monkeypatch.setattr(ShardedAttention, "_attend_gathered_tokens", spy_gathered)
    attend = sequence.METHODS[method]

    def spy(q, k, v, axis, **kwargs):
        split_calls.append((axis, int(q.shape[1])))  # q: [b, L/P, H, d_kv]
        return attend(q, k, v, axis, **kwargs)

    monkeypatch.setitem(sequence.METHODS, method, spy)
    axis = "model" if mesh == "model:2" else "seq"
    for beam_size in (1, 3):
        ids = model.translate(src, beam_size=beam_size, max_length=LENGTH).numpy()
        np.testing.assert_array_equal(
            ids, plain.translate(src, beam_size=beam_size, max_length=LENGTH).numpy())
        # Every encoder attention call ran on the axis, on its share of the 8 padded
        # tokens (traced by the first translate; the second reuses the step).
        assert split_calls and set(split_calls) == {(axis, LENGTH // 2)}, split_calls
    memory, mask = model.encode_split(tf.constant(src))
    expected_memory, expected_mask = plain.encode(tf.constant(src), training=False)
    np.testing.assert_array_equal(mask[:, :7], expected_mask.numpy())
    assert not mask[:, 7:].any()
    assert relative(memory[:, :7], expected_memory.numpy()) < 1e-5
    assert len(ids) == 3 and (ids != 0).any()


def test_translating_a_source_longer_than_the_split_allows_names_the_limit():
    import tensorflow as tf

    strategy = MeshStrategy("seq:2", "length:seq")
    with strategy.scope():
        model = Transformer(dataclasses.replace(_moe_config("ring"), max_length=12))
    # 9 tokens pad to 16 (a multiple of 2 x 2 chunks of moe_group_size=2), over max_length.
    with pytest.raises(ValueError, match=r"Sources of 9 tokens pad to 16 \(a multiple of 8: "
                                         r"2 x 2 zig-zag chunks over mesh axis 'seq' of "
                                         r"moe_group_size=2 tokens\), more than max_length=12; "
                                         r"translate sources of at most 8 tokens"):
        model.translate(tf.ones([1, 9], tf.int32), beam_size=2)
