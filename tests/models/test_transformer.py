"""The NMT Transformer: sharded (1x2, 2x2, MoE) equals one device; cached decoding; remat."""

import dataclasses
import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.layers import MoE
from tfdist.models import decoding
from tfdist.models.transformer import (
    BOS_ID,
    EOS_ID,
    InverseSqrtSchedule,
    SequenceCrossentropy,
    Transformer,
)
from tfdist.models.transformer_layers import TransformerConfig
from tfdist.strategies import MeshStrategy, get_strategy
from tfdist.testing.equivalence import assert_equivalent, max_rel_diff

V, BATCH, LS, LT = 32, 8, 8, 8
LAYOUT = "batch:data;heads:model;d_ff:model;vocab:model"


def _config(**overrides):
    base = dict(vocab_size=V, d_model=16, num_heads=4, d_kv=4, d_ff=32, num_encoder_layers=1,
                num_decoder_layers=1, max_length=16, dropout=0.0)
    return TransformerConfig(**{**base, **overrides})


def _batches(steps, seed=0):
    """Padded source/target pairs (varying lengths) like the NMT pipeline gives."""
    rng = np.random.default_rng(seed)
    n = steps * BATCH
    src = rng.integers(3, V, size=(n, LS)).astype("int32")
    tgt = rng.integers(3, V, size=(n, LT)).astype("int32")
    for i in range(n):
        src[i, rng.integers(3, LS):] = 0
        cut = rng.integers(2, LT)
        tgt[i, cut] = 2  # EOS
        tgt[i, cut + 1:] = 0
    decoder_input = np.concatenate([np.ones((n, 1), "int32"), tgt[:, :-1]], axis=1)
    decoder_input[decoder_input == 2] = 0  # BOS + target: EOS is not fed back
    return (src, decoder_input), tgt


CASES = [
    ("data:1;model:2", LAYOUT, {}),
    ("data:2;model:2", LAYOUT, {"share_embeddings": False, "positions": "learned"}),
    # The MoE Transformer (experts:model) on 1x2: tests/distribution/test_tfdist_models.py,
    # through its get_layout_map (the same rules and computation).
]


@pytest.mark.parametrize("mesh, layout, overrides", CASES)
def test_sharded_transformer_matches_one_device(mesh, layout, overrides):
    # Loss and gradients agree to ~5e-7; Adam divides by sqrt(v), so float32 sums in
    # another order reach ~1e-5 relative on the weights after 10 steps (1x2, one layer).
    # A routing bug shows as > 1e-2. 6 steps, for the suite's time budget.
    config = _config(**overrides)
    x, y = _batches(6)
    report = assert_equivalent(
        lambda: Transformer(config), MeshStrategy(mesh, layout), x, y,
        loss=SequenceCrossentropy(V, label_smoothing=0.1),
        optimizer=lambda: keras.optimizers.Adam(1e-3), batch_size=BATCH, steps=6,
        compare_outputs=False, reference=lambda: Transformer(config), rtol=5e-5)
    print(f"transformer {mesh} {overrides}: {report}")


def test_loss_is_the_mean_over_real_tokens_with_label_smoothing():
    (src, dec), tgt = _batches(1)
    keras.utils.set_random_seed(0)
    model = Transformer(_config())
    logits = model((src, dec)).numpy().astype("float64")
    loss = float(SequenceCrossentropy(V, label_smoothing=0.1)(tgt, logits))
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    target = 0.9 * np.eye(V)[tgt] + 0.1 / V
    per_token = -(target * logp).sum(-1)
    expected = per_token[tgt != 0].mean()
    assert abs(loss - expected) < 1e-5 * expected


def test_cached_decoding_matches_running_the_decoder_on_the_prefix():
    keras.utils.set_random_seed(1)
    model = Transformer(_config())
    (src, _), _ = _batches(1, seed=3)
    greedy = model.translate(src, beam_size=1, max_length=10, jit_compile=False).numpy()
    # Uncached: rerun the whole decoder on the growing prefix, take the argmax.
    memory, mask = model.encode(src)
    prefix = np.ones((len(src), 1), "int32")
    for _ in range(10):
        logits = model.output_logits(model.decode(prefix, memory, mask))[:, -1]
        prefix = np.concatenate([prefix, np.argmax(logits, -1)[:, None].astype("int32")], 1)
    uncached = prefix[:, 1:]
    for row, out in zip(uncached, greedy):
        eos = np.flatnonzero(row == 2)
        end = eos[0] + 1 if len(eos) else len(row)
        np.testing.assert_array_equal(out[:end], row[:end])
        assert (out[end:] == 0).all()


def test_xla_decoding_equals_graph_decoding_and_beam_1_equals_greedy():
    keras.utils.set_random_seed(2)
    model = Transformer(_config(moe_experts=4, moe_group_size=16))
    (src, _), _ = _batches(1, seed=4)
    graph = model.translate(src, beam_size=4, max_length=10, jit_compile=False).numpy()
    xla = model.translate(src, beam_size=4, max_length=10, jit_compile=True).numpy()
    np.testing.assert_array_equal(graph, xla)
    greedy = model.translate(src, beam_size=1, max_length=10).numpy()  # greedy_search
    np.testing.assert_array_equal(greedy, model.translate(src, beam_size=1, max_length=10,
                                                          jit_compile=False).numpy())
    # The other code path: beam_search itself with one beam and no length penalty.
    memory = model.memory_cache(*model.encode(tf.constant(src), training=False))
    step = functools.partial(model.decode_step, memory=memory)
    batch = src.shape[0]
    ids, _ = decoding.beam_search(step, tf.fill([batch], BOS_ID),
                                  model.initial_cache(batch, 10), 1, 10, EOS_ID, alpha=0.0)
    np.testing.assert_array_equal(ids[:, 0].numpy(), greedy)


def test_beam_search_with_the_encoder_part_repeated_once_equals_reordering_it_every_step():
    """`translate` keeps the encoder's keys/values out of the reordered cache."""
    keras.utils.set_random_seed(5)
    model = Transformer(_config(num_decoder_layers=2))
    (src, _), _ = _batches(1, seed=6)
    memory = model.memory_cache(*model.encode(src))
    cache = {**model.initial_cache(len(src), 10), "memory": memory}

    def step(ids, index, cache):  # everything, the encoder's part too, goes through the beam
        logits, new = model.decode_step(ids, index, cache, cache["memory"])
        return logits, {**new, "memory": cache["memory"]}

    ids, _ = decoding.beam_search(step, np.ones(len(src), "int32"), cache, 3, 10, 2, alpha=0.6)
    np.testing.assert_array_equal(
        model.translate(src, beam_size=3, max_length=10, jit_compile=False).numpy(),
        ids[:, 0].numpy())


def test_a_model_trained_on_a_mesh_translates_like_its_single_device_copy():
    strategy = MeshStrategy("data:2;model:2", LAYOUT)
    config = _config()
    with strategy.scope():
        model = Transformer(config)
    keras.utils.set_random_seed(0)
    plain = Transformer(config)
    model.set_weights(plain.get_weights())
    (src, _), _ = _batches(1)
    np.testing.assert_array_equal(model.translate(src, beam_size=2, max_length=8).numpy(),
                                  plain.translate(src, beam_size=2, max_length=8).numpy())


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="num_heads must be a positive integer; received num_heads=0"):
        Transformer(_config(num_heads=0))
    with pytest.raises(ValueError, match="positions must be 'sinusoidal' or 'learned'"):
        _config(positions="rope").validate()
    with pytest.raises(ValueError, match="heads"):  # 4 heads do not split over 3 devices
        with MeshStrategy("data:1;model:3", LAYOUT).scope():
            Transformer(_config(vocab_size=33, d_ff=33))
    with pytest.raises(ValueError, match="moe_top_k must be from 1 to moe_experts=4; received "
                                         "moe_top_k=5"):
        _config(moe_experts=4, moe_top_k=5).validate()
    # Expert choice is not causal: refused where the decoder has MoE blocks (1, 3, ...),
    # by the config and by the layer itself.
    with pytest.raises(ValueError, match="expert_choice.*not causal.*num_decoder_layers=2"):
        _config(moe_experts=4, moe_routing="expert_choice", num_decoder_layers=2).validate()
    with pytest.raises(ValueError, match="causal"):
        MoE(4, 8, routing="expert_choice", causal=True)


def test_get_config_round_trip_and_schedule():
    model = Transformer(_config(moe_experts=2, moe_top_k=1))
    clone = Transformer.from_config(model.get_config())
    assert clone.model_config == model.model_config
    # An encoder-side expert-choice MoE (one decoder block: no MoE there), shared experts.
    model = Transformer(_config(moe_experts=2, moe_routing="expert_choice", moe_shared_d_ff=8,
                                num_encoder_layers=2, num_decoder_layers=1))
    clone = Transformer.from_config(model.get_config())
    assert clone.model_config == model.model_config
    moe = [layer for layer in model._flatten_layers() if isinstance(layer, MoE)]
    assert [(m.routing, m.shared_d_ff, m.causal) for m in moe] == [("expert_choice", 8, False)]
    schedule = InverseSqrtSchedule(16, warmup_steps=10)
    lrs = [float(schedule(s)) for s in range(30)]
    assert np.argmax(lrs) == 9 and lrs[0] < lrs[9] and lrs[29] < lrs[9]


@pytest.mark.parametrize("strategy_name", ["mirrored", "mesh"])
def test_sequence_crossentropy_under_other_strategies_matches_one_device(strategy_name):
    """The global token count is summed by whatever strategy runs (not N x the gradient)."""
    config = _config()
    x, y = _batches(6)
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    # MirroredStrategy through one device: TF's collectives would share instance keys
    # with any other MirroredStrategy of this test process.
    strategy = (tf.distribute.MirroredStrategy(cpus, tf.distribute.ReductionToOneDevice())
                if strategy_name == "mirrored" else get_strategy("mesh", mesh_shape="data:2",
                                                                 devices=cpus))
    report = assert_equivalent(
        lambda: Transformer(config), strategy, x, y,
        loss=SequenceCrossentropy(V, label_smoothing=0.1),
        optimizer=lambda: keras.optimizers.SGD(0.5), batch_size=BATCH, steps=6,
        compare_outputs=False, reference=lambda: Transformer(config), rtol=1e-5)
    print(f"transformer under {strategy_name}: {report}")


# -- recomputation (TransformerConfig(remat="full" | "selective")) -------------
# On a 1x2 mesh (tensor-parallel attention, FFN, vocabulary and experts over
# `model`, so collectives run again inside every recomputed block), with dropout
# on and an MoE block (whose balancing loss must keep its gradient): each step's
# loss, then weights, optimizer and seed states after 5 Adam steps, equal the
# same model keeping its activations.

REMAT_MESH = "data:1;model:2"
REMAT_LAYOUT = LAYOUT + ";experts:model"
REMAT_STEPS = 5


def _matmul_ops(model, x):
    """How many einsum/matmul ops one training step's graph holds (forward + backward)."""

    @tf.function
    def step(source, target_input):
        with tf.GradientTape() as tape:
            logits = model((source, target_input), training=True)
            loss = tf.reduce_sum(logits) + sum(model.losses, 0.0)
        return tape.gradient(loss, model.trainable_variables)

    graph = step.get_concrete_function(*[tf.constant(a[:BATCH]) for a in x]).graph
    return sum(op.type in ("Einsum", "MatMul", "BatchMatMulV2") for op in graph.get_operations())


def test_recomputation_trains_like_kept_activations_with_collectives_moe_and_dropout():
    config = _config(dropout=0.2, num_encoder_layers=2, moe_experts=2, moe_group_size=8)
    x, y = _batches(REMAT_STEPS)
    runs = {}
    for remat in ("none", "full", "selective"):
        strategy = MeshStrategy(REMAT_MESH, REMAT_LAYOUT)
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = Transformer(dataclasses.replace(config, remat=remat))
            model.compile(keras.optimizers.Adam(1e-3), SequenceCrossentropy(V, 0.1))
        losses = []  # each step's loss, the MoE's balancing loss included
        record = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: losses.append(logs["loss"]))
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                  callbacks=[record])
        runs[remat] = (losses, [v.numpy() for v in model.weights],
                       [v.numpy() for v in model.optimizer.variables],
                       [v.numpy() for v in model.variables if "seed" in v.path])
    assert any(isinstance(layer, MoE) and layer.aux_loss_coef > 0
               for layer in model._flatten_layers())
    losses, weights, slots, seeds = runs.pop("none")
    assert len(losses) == REMAT_STEPS and seeds
    # Identical weights and Adam slots after 5 steps: identical gradients at every step.
    for remat, (losses_r, weights_r, slots_r, seeds_r) in runs.items():
        assert all(np.array_equal(a, b) for a, b in zip(seeds_r, seeds))
        assert max_rel_diff(losses_r, losses) <= 1e-6
        worst_weight = max(max_rel_diff(a, b) for a, b in zip(weights_r, weights))
        worst_slot = max(max_rel_diff(a, b) for a, b in zip(slots_r, slots))
        print(f"remat={remat} vs kept on {REMAT_MESH}: losses "
              f"{max_rel_diff(losses_r, losses):.1e}, weights {worst_weight:.1e}, "
              f"optimizer {worst_slot:.1e}")
        assert worst_weight < 1e-5 and worst_slot < 1e-5


def test_the_recomputation_is_in_the_graph():
    config = _config(num_encoder_layers=1, num_decoder_layers=1)
    x, _ = _batches(1)
    counts = {}
    for remat in ("none", "full", "selective"):
        keras.utils.set_random_seed(0)
        counts[remat] = _matmul_ops(Transformer(dataclasses.replace(config, remat=remat)), x)
    # Full: every block's projections run once more in the backward pass; selective:
    # only the attention cores' two einsums (3 attentions here).
    assert counts["full"] > counts["selective"] == counts["none"] + 3 * 2, counts
