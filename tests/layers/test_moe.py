"""MoE: hand-computed routing, equivalence with a per-token loop, sharding, learning."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.layers import MoE, moe_routing
from tfdist.layers.moe import expert_capacity
from tfdist.strategies import MeshStrategy
from tfdist.testing.equivalence import assert_equivalent, run_reference
from tfdist.testing.gshard_gating import gshard_top_k_gating

# -- routing on tiny hand-computed cases --------------------------------------


def _logits(rows):
    return tf.constant([rows], dtype=tf.float32)  # one group [1, S, E]


def _taken(routing, logits, group=0):
    """{expert: [(token, gate), ...]} of one group, in slot order, empty slots left out."""
    tokens, gates = routing.slot_token.numpy(), routing.slot_gate.numpy()
    empty = logits.shape[0] * logits.shape[1]  # the zero row after the tokens
    assert (gates[tokens == empty] == 0).all()
    return {e: [(int(t), float(g)) for t, g in zip(tokens[e, group], gates[e, group])
                if t != empty] for e in range(tokens.shape[0])}


def _tokens(taken):
    return {e: [t for t, _ in slots] for e, slots in taken.items()}


def test_top1_routing_and_capacity_drop_exactly_the_late_tokens():
    # 5 tokens, 2 experts, capacity 2: tokens 0, 1, 3 prefer expert 0; 2, 4 expert 1.
    logits = _logits([[2.0, 0.0], [1.0, 0.0], [0.0, 3.0], [4.0, 0.0], [0.0, 1.0]])
    routing = moe_routing.token_choice(logits, top_k=1, capacity=2)
    taken = _taken(routing, logits)
    assert _tokens(taken) == {0: [0, 1], 1: [2, 4]}  # token 3 is over capacity: dropped
    probs = tf.nn.softmax(logits[0]).numpy()
    np.testing.assert_allclose(taken[0][0][1], probs[0, 0], rtol=1e-6)  # top-1: the probability
    stats = routing.stats
    np.testing.assert_allclose(stats["dropped_fraction"].numpy(), 0.2, rtol=1e-6)
    np.testing.assert_allclose(stats["load"].numpy(), [0.4, 0.4], rtol=1e-6)
    # aux = E^2 * mean_e(density_e * mean_prob_e), density before capacity: [3/5, 2/5]
    expected_aux = 4 * np.mean(np.array([0.6, 0.4]) * probs.mean(axis=0))
    np.testing.assert_allclose(stats["aux_loss"].numpy(), expected_aux, rtol=1e-6)


def test_top2_gates_are_renormalised_and_second_choices_come_after_first():
    # 3 tokens, 3 experts, capacity 2.
    logits = _logits([[3.0, 2.0, 0.0], [3.0, 0.0, 2.0], [0.0, 3.0, 2.0]])
    taken = _taken(moe_routing.token_choice(logits, top_k=2, capacity=2), logits)
    # Top-1: tokens 0, 1 -> expert 0 (slots 0, 1); token 2 -> expert 1 (slot 0).
    # Top-2: token 0 -> expert 1 slot 1 (after token 2's top-1), token 1 -> expert 2
    # slot 0, token 2 -> expert 2 slot 1.
    assert _tokens(taken) == {0: [0, 1], 1: [2, 0], 2: [1, 2]}
    probs = tf.nn.softmax(logits[0]).numpy()
    g1, g2 = probs[0, 0], probs[0, 1]
    np.testing.assert_allclose(taken[0][0][1], g1 / (g1 + g2), rtol=1e-6)
    np.testing.assert_allclose(taken[1][1][1], g2 / (g1 + g2), rtol=1e-6)


def test_top2_second_choice_over_capacity_is_dropped_but_first_kept():
    logits = _logits([[3.0, 2.0], [3.0, 2.0], [2.0, 3.0]])
    taken = _tokens(_taken(moe_routing.token_choice(logits, top_k=2, capacity=2), logits))
    # Expert 0: top-1 of tokens 0, 1 fill it; token 2's second choice (0) is dropped.
    # Expert 1: token 2 (top-1) then token 0 (top-2); token 1's top-2 is dropped.
    assert taken == {0: [0, 1], 1: [2, 0]}


def test_top3_choices_fill_experts_rank_by_rank():
    # 3 tokens, 4 experts, capacity 2. Choices: token 0 -> 0, 1, 2; token 1 -> 0, 2, 3;
    # token 2 -> 1, 2, 3.
    logits = _logits([[4.0, 3.0, 2.0, 0.0], [4.0, 0.0, 3.0, 2.0], [0.0, 4.0, 3.0, 2.0]])
    routing = moe_routing.token_choice(logits, top_k=3, capacity=2)
    taken = _taken(routing, logits)
    # First choices: expert 0 <- 0, 1; expert 1 <- 2. Second: expert 1 <- 0; expert 2 <- 1, 2.
    # Third: token 0's expert 2 is full (dropped); expert 3 <- 1, 2.
    assert _tokens(taken) == {0: [0, 1], 1: [2, 0], 2: [1, 2], 3: [1, 2]}
    probs = tf.nn.softmax(logits[0]).numpy()
    top = probs[1, [0, 2, 3]]  # token 1's three gates, renormalised over the three
    np.testing.assert_allclose([taken[0][1][1], taken[2][0][1], taken[3][0][1]],
                               top / top.sum(), rtol=1e-6)
    assert routing.stats["dropped_fraction"].numpy() == 0  # first choices all kept


def test_threshold_policy_drops_weak_second_choices():
    logits = _logits([[5.0, 0.0], [1.0, 0.9]])
    taken = _tokens(_taken(moe_routing.token_choice(
        logits, top_k=2, capacity=4, second_expert_policy="threshold",
        second_expert_threshold=0.2), logits))
    # token 0's gate_2 ~ 0.007 < 0.2: dropped; token 1's ~ 0.475 > 0.2: kept.
    assert taken == {0: [0, 1], 1: [1]}


def test_expert_choice_each_expert_takes_its_best_tokens():
    # 4 tokens, 3 experts, capacity 1. Probabilities (softmax over experts):
    # token 0 (0.91, 0.05, 0.05), token 1 (0.06, 0.47, 0.47), token 2 (0.42, 0.42, 0.16),
    # token 3 (1/3, 1/3, 1/3): experts 1 and 2 both take token 1; tokens 2, 3 go nowhere.
    logits = _logits([[3.0, 0.0, 0.0], [0.0, 2.0, 2.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    routing = moe_routing.expert_choice(logits, capacity=1)
    taken = _taken(routing, logits)
    probs = tf.nn.softmax(logits[0]).numpy()
    assert _tokens(taken) == {0: [0], 1: [1], 2: [1]}
    np.testing.assert_allclose([taken[e][0][1] for e in range(3)],
                               [probs[0, 0], probs[1, 1], probs[1, 2]], rtol=1e-6)
    np.testing.assert_allclose(routing.stats["dropped_fraction"].numpy(), 0.5)
    np.testing.assert_allclose(routing.stats["load"].numpy(), [0.25, 0.25, 0.25])
    assert routing.stats["aux_loss"].numpy() == 0
    # Token 1 is padding: never taken; expert 1 takes token 2 instead, expert 2 token 3.
    masked = moe_routing.expert_choice(logits, capacity=1,
                                       token_mask=tf.constant([[1.0, 0.0, 1.0, 1.0]]))
    assert _tokens(_taken(masked, logits)) == {0: [0], 1: [2], 2: [3]}
    np.testing.assert_allclose(masked.stats["dropped_fraction"].numpy(), 0.0)


def test_dropless_buffers_fit_the_busiest_expert_and_drop_nothing():
    # 6 tokens in 2 groups of 3, top-1: five choose expert 0, one expert 1.
    logits = tf.constant([[[2.0, 0.0], [2.0, 0.0], [0.0, 2.0]],
                          [[2.0, 0.0], [2.0, 0.0], [2.0, 0.0]]])
    routing = moe_routing.token_choice(logits, top_k=1, capacity=None)
    assert routing.slot_token.shape == (2, 1, 5)  # one buffer per expert, 5 slots
    assert _tokens(_taken(routing, logits)) == {0: [0, 1, 3, 4, 5], 1: [2]}
    assert routing.stats["dropped_fraction"].numpy() == 0
    # Buffers agreed with the other devices of the expert axis (their busiest: 9),
    # rounded up to a bucket (10), never above the tokens routed (6).
    agreed = moe_routing.token_choice(logits, top_k=1, capacity=None,
                                      agree_capacity=lambda busiest: busiest + 4)
    assert agreed.slot_token.shape == (2, 1, 6)
    assert [int(moe_routing.bucket_size(n)) for n in (1, 9, 16, 17, 19, 33, 100, 1000)] == \
        [1, 9, 16, 18, 20, 36, 104, 1024]


def test_the_router_equals_gshard_one_hot_gating():
    """`token_choice`'s slots are GShard's one-hot dispatch and combine tensors (written
    independently, `tfdist.testing.gshard_gating`), also through `moe_routing.one_hot`."""
    rng = np.random.default_rng(0)
    for top_k, capacity, policy, masked in [(1, 2, "all", False), (2, 3, "all", False),
                                            (2, 2, "threshold", True)]:
        logits = tf.constant(rng.normal(size=(3, 6, 4)), tf.float32)
        mask = tf.constant(rng.integers(0, 2, (3, 6)), tf.float32) if masked else None
        routing = moe_routing.token_choice(logits, top_k, capacity, policy, 0.3,
                                           token_mask=mask)
        dispatch, combine, stats = gshard_top_k_gating(logits, top_k, capacity, policy, 0.3,
                                                       token_mask=mask)
        one_hot = np.zeros((3, 6, 4, capacity, 2))  # [G, S, E, C, (dispatch, combine)]
        tokens, gates = routing.slot_token.numpy(), routing.slot_gate.numpy()
        for (e, g, c), t in np.ndenumerate(tokens):
            if t < 18:
                assert t // 6 == g
                one_hot[g, t % 6, e, c] = 1.0, gates[e, g, c]
        np.testing.assert_array_equal(one_hot[..., 0], dispatch.numpy())
        np.testing.assert_allclose(one_hot[..., 1], combine.numpy(), rtol=1e-6)
        for name, value in stats.items():
            np.testing.assert_allclose(routing.stats[name].numpy(), value.numpy(), rtol=1e-6)
        ours = moe_routing.one_hot(routing, 6)  # what dispatch="one_hot" multiplies by
        np.testing.assert_array_equal(ours[0].numpy(), dispatch.numpy())
        np.testing.assert_allclose(ours[1].numpy(), combine.numpy(), rtol=1e-6)


@pytest.mark.parametrize("routing", [dict(top_k=2), dict(top_k=3),
                                     dict(routing="expert_choice")])
def test_index_dispatch_layer_equals_one_hot_dispatch_layer(routing):
    x = np.random.default_rng(1).normal(size=(4, 4, 8)).astype("float32")
    outputs = []
    for dispatch in ("index", "one_hot"):
        layer = MoE(4, 16, capacity_factor=1.0, min_capacity=1, group_size=4,
                    dispatch=dispatch, z_loss_coef=1e-3, **routing)
        layer.build(x.shape)
        if outputs:
            layer.set_weights(weights)
        weights = layer.get_weights()
        with tf.GradientTape() as tape:
            y = layer(x, training=True)
            loss = tf.reduce_sum(y * y) + tf.add_n(layer.losses)
        outputs.append((y, loss, tape.gradient(loss, layer.trainable_weights)))
    (y1, l1, g1), (y2, l2, g2) = outputs
    np.testing.assert_allclose(y1, y2, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_shared_experts_add_an_always_on_ffn():
    x = np.random.default_rng(2).normal(size=(2, 4, 8)).astype("float32")
    layer = MoE(4, 16, shared_d_ff=6, group_size=4)
    routed = MoE(4, 16, group_size=4)
    layer.build(x.shape)
    routed.build(x.shape)
    routed.set_weights(layer.get_weights()[:3])
    shared = np.maximum(x @ layer.shared_wi.numpy(), 0) @ layer.shared_wo.numpy()
    np.testing.assert_allclose(layer(x), routed(x) + shared, rtol=1e-5, atol=1e-6)


def test_capacity_formula():
    assert expert_capacity(8, 4, 2, 1.0, 1) == 4
    assert expert_capacity(1024, 8, 2, 1.25, 4) == 320
    assert expert_capacity(8, 64, 1, 1.0, 4) == 4
    assert expert_capacity(8, 2, 2, 4.0, 1) == 8


# -- arguments -----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(top_k=0), "top_k=0"),
        (dict(top_k=5), "from 1 to num_experts=4"),
        (dict(top_k=3, second_expert_policy="threshold"), "top_k=3"),
        (dict(routing="expert"), "routing='expert'"),
        (dict(routing="expert_choice", causal=True), "causal"),
        (dict(routing="expert_choice", top_k=1), "top_k=1"),
        (dict(routing="expert_choice", dropless=True), "routing='expert_choice'"),
        (dict(shared_d_ff=-1), "shared_d_ff=-1"),
        (dict(dispatch="sort"), "dispatch='sort'"),
        (dict(dispatch="one_hot", dropless=True), "dropless=True"),
        (dict(num_experts=0), "num_experts=0"),
        (dict(second_expert_policy="random"), "second_expert_policy='random'"),
        (dict(capacity_factor=0), "capacity_factor=0"),
        (dict(dropout=1.0), "dropout=1.0"),
        (dict(group_size=-4), "group_size=-4"),
        (dict(router_jitter=-0.1), "router_jitter=-0.1"),
    ],
)
def test_bad_arguments(kwargs, fragment):
    args = dict(num_experts=4, d_ff=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=fragment):
        MoE(**args)


def test_config_round_trip():
    layer = MoE(8, 32, top_k=1, capacity_factor=1.5, second_expert_policy="threshold",
                group_size=64, z_loss_coef=1e-3, router_jitter=0.01, dropout=0.1, seed=3)
    assert MoE.from_config(layer.get_config()).get_config() == layer.get_config()
    for kwargs in (dict(routing="expert_choice"), dict(top_k=5, dropless=True, shared_d_ff=16),
                   dict(dispatch="one_hot", causal=True)):
        layer = MoE(8, 32, **kwargs)
        assert MoE.from_config(layer.get_config()).get_config() == layer.get_config()


def test_group_size_must_divide_tokens():
    layer = MoE(4, 8, group_size=6)
    with pytest.raises(ValueError, match="group_size=6 must divide the 8 tokens"):
        layer(np.zeros((2, 4, 8), "float32"), training=True)
    # Inference (e.g. one decoding step of batch * beam tokens) uses the largest
    # group size that divides the tokens: gcd(8, 6) = 2.
    assert tuple(layer(np.zeros((2, 4, 8), "float32")).shape) == (2, 4, 8)


# -- equivalence with the per-token loop, over meshes ---------------------------

BATCH, LENGTH, D_MODEL = 8, 2, 8


# One model, five MoE layers: every routing mode in one trace per mesh.
MODES = {
    "top1": dict(top_k=1, capacity_factor=1.0),
    "top2": dict(top_k=2, capacity_factor=1.0),
    "top4_shared": dict(top_k=4, capacity_factor=0.5, shared_d_ff=8),  # drops, shared FFN
    "expert_choice": dict(routing="expert_choice", capacity_factor=2.0),
    "dropless": dict(top_k=2, dropless=True),  # buffer sizes change from step to step
}


def _moe_model():
    x = inputs = keras.Input((LENGTH, D_MODEL))
    for name, kwargs in MODES.items():
        x = x + MoE(4, 16, min_capacity=1, group_size=4, aux_loss_coef=1e-1, z_loss_coef=1e-3,
                    name=name, **kwargs)(x)
    return keras.Model(inputs, x)


def _data(steps):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * BATCH, LENGTH, D_MODEL)).astype("float32")
    y = np.tanh(x[..., ::-1] * 2.0).astype("float32")
    return x, y


# The expert FFN with its hidden units split (d_ff:model; the routing does not see the
# split, so one mode suffices): two MoE layers on 2x2 in
# tests/strategies/test_partial_batches.py, against the no-drop reference.
# Experts over a 2-device axis: data:2;model:2 (data:1;model:2 ran the same exchanges
# without the data axis: dropped for the suite's time, 31 CPU-s).
EQUIVALENCE_CASES = [("data:1;model:1", "experts:model"),
                     ("data:2;model:2", "batch:data;experts:model"),
                     ("data:1;model:4", "experts:model")]


EQUIVALENCE = dict(loss=keras.losses.MeanSquaredError(),
                   optimizer=lambda: keras.optimizers.Adam(0.01), batch_size=BATCH, steps=20)


@pytest.fixture(scope="session")
def per_token_run(computed_once):
    """The per-token loop's results, once per test run (all workers): it takes about
    as long as the meshes' runs (eagerly; its trace would take twice as long)."""
    return computed_once("moe_per_token_run", lambda: run_reference(
        _moe_model, *_data(20), run_eagerly=True, **EQUIVALENCE))


@pytest.mark.parametrize("mesh, layout", EQUIVALENCE_CASES)
def test_moe_matches_per_token_loop(mesh, layout, per_token_run):
    report = assert_equivalent(_moe_model, MeshStrategy(mesh, layout), *_data(20),
                               reference_run=per_token_run, rtol=1e-5, **EQUIVALENCE)
    print(f"MoE {list(MODES)} {mesh} {layout}: {report}")


def _dropless_model():
    x = inputs = keras.Input((LENGTH, D_MODEL))
    y = MoE(4, 16, group_size=4, top_k=2, dropless=True, shared_d_ff=8, aux_loss_coef=1e-1,
            z_loss_coef=1e-3, name="dropless")(x)
    return keras.Model(inputs, x + y)


# Experts not split (data parallel, or their hidden units split): dropless computes each
# expert's FFN on exactly its own rows, not on padded buffers (the path the meshes above,
# all splitting experts but 1x1, take).
@pytest.mark.parametrize("mesh, layout", [("data:2;model:1", "batch:data"),
                                          ("data:2;model:2", "batch:data;d_ff:model")])
def test_dropless_with_whole_experts_matches_per_token_loop(mesh, layout, computed_once):
    reference = computed_once("moe_dropless_per_token_run", lambda: run_reference(
        _dropless_model, *_data(20), run_eagerly=True, **EQUIVALENCE))
    report = assert_equivalent(_dropless_model, MeshStrategy(mesh, layout), *_data(20),
                               reference_run=reference, rtol=1e-5, **EQUIVALENCE)
    print(f"MoE dropless {mesh} {layout}: {report}")


def test_expert_weights_are_one_share_per_device():
    strategy = MeshStrategy("data:2;model:4", "batch:data;experts:model")
    with strategy.scope():
        layer = MoE(8, 16, group_size=8)
        layer.build((None, 4, 6))
    for weight, local in ((layer.wi, (2, 6, 16)), (layer.wo, (2, 16, 6))):
        components = weight.value.values
        assert [tuple(c.shape) for c in components] == [local] * 8
        assert sum(c.shape.num_elements() for c in components[:4]) == np.prod(weight.shape)
    assert [tuple(c.shape) for c in layer.router.value.values] == [(6, 8)] * 8


# -- learning -------------------------------------------------------------------


def test_moe_learns_cluster_specific_maps_better_than_dense_with_same_active_params():
    """Tokens from 8 clusters, each needing its own linear map: experts help.

    The dense baseline's hidden layer has top_k * d_ff units, the hidden units
    each MoE token activates; expert choice at capacity factor 2 gives each
    token two experts on average, the same.
    """
    m, h, e, length, clusters = 16, 16, 8, 8, 8
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(clusters, m)) * 3
    maps = rng.normal(size=(clusters, m, m)) / np.sqrt(m)

    def data(n):
        c = rng.integers(0, clusters, size=(n, length))
        x = centers[c] + rng.normal(size=(n, length, m)) * 0.5
        return x.astype("float32"), np.einsum("nlm,nlmk->nlk", x, maps[c]).astype("float32")

    x, y = data(8192)
    x_test, y_test = data(1024)

    def build(kind):
        inputs = keras.Input((length, m))
        z = keras.layers.Dense(m, name="embed")(inputs)
        if kind == "top2":
            z = z + MoE(e, h, top_k=2, group_size=64, name="moe")(z)
        elif kind == "expert_choice":
            z = z + MoE(e, h, routing="expert_choice", capacity_factor=2.0, group_size=64,
                        name="moe")(z)
        else:
            z = z + keras.layers.Dense(m)(keras.layers.Dense(2 * h, activation="relu")(z))
        return keras.Model(inputs, keras.layers.Dense(m)(z))

    results = {}
    for kind in ("top2", "expert_choice", "dense"):
        keras.utils.set_random_seed(0)
        model = build(kind)
        model.compile(keras.optimizers.Adam(3e-3), "mse")
        history = model.fit(x, y, batch_size=64, epochs=10, verbose=0)
        results[kind] = (model.evaluate(x_test, y_test, verbose=0, return_dict=True)["loss"],
                         {k: v[-1] for k, v in history.history.items()})
    dense = results["dense"][0]
    for kind in ("top2", "expert_choice"):
        loss, last = results[kind]
        print(f"{kind}: test mse {loss:.3f} (dense {dense:.3f}); max load "
              f"{last['moe_max_load']:.3f}, dropped {last['moe_dropped']:.4f}")
        assert loss < 0.75 * dense
        assert {"moe_aux_loss", "moe_z_loss", "moe_dropped", "moe_max_load"} <= set(last)
    top2 = results["top2"][1]
    # Busiest expert under 2x its fair share in the last epoch (2.0 in the first): 1.76
    # on an AVX2 CPU, under 1.5 on an AVX-512 one (the same run in other roundings).
    assert top2["moe_max_load"] < 1.9
    assert top2["moe_dropped"] < 0.01
    assert results["expert_choice"][1]["moe_dropped"] < 0.2  # tokens no expert took


def test_sampling_policy_keeps_second_choices_in_proportion_to_their_gate():
    # Every token: gate_2 = 0.1 after renormalisation; threshold 0.2 -> kept with p = 0.5.
    p = np.log(np.array([0.9, 0.1]))
    logits = tf.constant(np.tile(p, (1, 4000, 1)), dtype=tf.float32)
    seed = keras.random.SeedGenerator(1)
    routing = moe_routing.token_choice(logits, top_k=2, capacity=8000,
                                       second_expert_policy="sampling",
                                       second_expert_threshold=0.2, training=True, seed=seed)
    kept = int(tf.reduce_sum(tf.cast(routing.slot_token[1] < 4000, tf.int32))) / 4000
    assert 0.45 < kept < 0.55
    routing = moe_routing.token_choice(logits, top_k=2, capacity=8000,
                                       second_expert_policy="sampling",
                                       second_expert_threshold=0.2, training=False)
    assert int(tf.reduce_sum(tf.cast(routing.slot_token[1] < 4000, tf.int32))) == 0


def test_jitter_and_dropout_act_only_in_training():
    layer = MoE(4, 8, group_size=4, router_jitter=0.5, dropout=0.5, seed=0)
    x = np.random.default_rng(0).normal(size=(2, 4, 6)).astype("float32")
    np.testing.assert_array_equal(layer(x, training=False), layer(x, training=False))
    assert not np.allclose(layer(x, training=True), layer(x, training=False))


# -- XLA ------------------------------------------------------------------------


def _length_buckets(steps=4):
    """Batches of BATCH rows whose length changes (2, then 4 positions): the step's
    input shape is not static, as with tf.data's length buckets."""
    rng = np.random.default_rng(1)

    def batches():
        for step in range(steps):
            x = rng.normal(size=(BATCH, 2 + 2 * (step % 2), D_MODEL)).astype("float32")
            yield x, np.tanh(x[..., ::-1] * 2.0).astype("float32")

    spec = tf.TensorSpec((BATCH, None, D_MODEL), tf.float32)
    return tf.data.Dataset.from_generator(batches, output_signature=(spec, spec))


# Dropless buffers are sized at run time: such a model runs without XLA (Keras's
# fall-back, checked below).
XLA_MODES = {**{k: v for k, v in MODES.items() if not v.get("dropless")},
             "top3": dict(top_k=3, capacity_factor=1.0),
             "top2_threshold": dict(top_k=2, second_expert_policy="threshold"),
             "top2_one_hot": dict(top_k=2, dispatch="one_hot")}


def _every_mode_model(modes=XLA_MODES):
    x = inputs = keras.Input((None, D_MODEL))
    for name, kwargs in modes.items():
        x = x + MoE(4, 16, min_capacity=1, group_size=4, name=name, **kwargs)(x)
    return keras.Model(inputs, x)


def test_every_moe_option_trains_under_xla_like_without_it():
    # Under a one-device mesh the step's shape keys (string ops) once kept XLA from
    # compiling any model fed length buckets: "No registered 'AsString' OpKernel".
    histories = {}
    for jit in (True, False):
        keras.utils.set_random_seed(0)
        strategy = MeshStrategy("data:1")
        with strategy.scope():
            model = _every_mode_model()
            model.compile(keras.optimizers.Adam(0.01), "mse", jit_compile=jit)
        assert model.jit_compile is jit
        histories[jit] = model.fit(_length_buckets(), epochs=1, verbose=0).history["loss"]
    np.testing.assert_allclose(histories[True], histories[False], rtol=1e-4)
    # Sampled second choices compile too (XLA draws other random numbers: no equality).
    with strategy.scope():
        sampling = _every_mode_model({"sampling": dict(top_k=2, second_expert_policy="sampling")})
        sampling.compile("adam", "mse", jit_compile=True)
    assert sampling.jit_compile is True
    assert np.isfinite(sampling.fit(_length_buckets(2), verbose=0).history["loss"]).all()
    with strategy.scope(), pytest.warns(UserWarning, match="Proceeding with `jit_compile=False`"):
        dropless = _every_mode_model({"dropless": MODES["dropless"]})
        dropless.compile("adam", "mse", jit_compile=True)
    assert dropless.jit_compile is False
