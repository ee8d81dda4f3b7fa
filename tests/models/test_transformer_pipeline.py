"""tfdist's Transformer cut into pipeline stages trains like the unpipelined Transformer.

The reference is `Transformer(config)` on one device, given the pipeline's
initial weights by path, trained by Keras's `fit` on whole batches: the loss
is the mean over the batch's real tokens, so the pipeline weights each
micro-batch's loss by its share of them (`SequenceCrossentropy.normalizer`).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfdist.models.transformer import SequenceCrossentropy, Transformer
from tfdist.models.transformer_layers import TransformerConfig
from tfdist.models.transformer_pipeline import (
    TransformerPipeline, pipelined_transformer, transformer_stages, transformer_weights)
from tfdist.pipeline.layout import PipelinePlan
from tfdist.pipeline.model import Pipeline
from tfdist.testing.pipeline import relative

V, BATCH, LS, LT, STEPS = 32, 10, 8, 7, 10


def _batches(steps, seed=0, LS=LS, LT=LT):  # noqa: N803
    """Padded pairs of varying lengths: micro-batches hold different token counts."""
    rng = np.random.default_rng(seed)
    n = steps * BATCH
    src = rng.integers(3, V, size=(n, LS)).astype("int32")
    tgt = rng.integers(3, V, size=(n, LT)).astype("int32")
    for i in range(n):
        src[i, rng.integers(2, LS):] = 0
        cut = rng.integers(1, LT)
        tgt[i, cut] = 2
        tgt[i, cut + 1:] = 0
    decoder_input = np.concatenate([np.ones((n, 1), "int32"), tgt[:, :-1]], axis=1)
    decoder_input[decoder_input == 2] = 0
    return (src, decoder_input), tgt


def _one_device_copy(config, weights):
    """`Transformer(config)` on one device with the pipeline's weights (by path),
    and its weights by those paths."""
    with tf.device("/cpu:0"):
        ref = Transformer(config)
    ref_paths = {"/".join(v.path.split("/")[1:]): v for v in ref.weights}
    assert sorted(ref_paths) == sorted(weights)
    for path, v in ref_paths.items():
        v.assign(weights[path])
    return ref, ref_paths


@pytest.mark.parametrize("stages,m,overrides", [
    (2, 3, {}),
    (4, 4, {"share_embeddings": False, "positions": "learned"}),
])
def test_pipelined_transformer_matches_one_device(stages, m, overrides):
    keras.utils.set_random_seed(stages)
    config = TransformerConfig(vocab_size=V, d_model=16, num_heads=2, d_kv=8, d_ff=32,
                               num_encoder_layers=2, num_decoder_layers=2, max_length=16,
                               dropout=0.0, **overrides)
    plan = PipelinePlan.from_mesh(f"stage:{stages}", "layers:stage", num_layers=4,
                                  num_microbatches=m, global_batch=BATCH)
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i + 1}" for i in range(stages)]
    pipeline = Pipeline(transformer_stages(config, plan), devices=devices, schedule="1f1b",
                        num_microbatches=m, input_shape=((LS,), (LT,)),
                        input_dtype=("int32", "int32"))
    # The tied table on the first stage that uses it; every block on its stage's device.
    weights = transformer_weights(pipeline.stages)
    assert weights["target_embedding/embeddings"].value.device == devices[0 if stages == 2
                                                                           else 1]
    assert weights["decoder_1/ffn/outer/kernel"].value.device == devices[-1]
    ref, ref_paths = _one_device_copy(config, weights)

    initial = ref_paths["encoder_0/ffn/inner/kernel"].numpy()
    x, y = _batches(STEPS)
    loss = SequenceCrossentropy(V, label_smoothing=0.1)
    np.testing.assert_allclose(pipeline.predict(x, batch_size=BATCH, verbose=0),
                               ref.predict(x, batch_size=BATCH, verbose=0), rtol=1e-5, atol=1e-5)
    for model in (pipeline, ref):
        model.compile(keras.optimizers.Adam(1e-3), loss)
    history = pipeline.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    ref_history = ref.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    assert abs(history["loss"][0] - ref_history["loss"][0]) < 1e-5 * ref_history["loss"][0]
    errors = {path: relative(weights[path], v) for path, v in ref_paths.items()}
    worst = max(errors, key=errors.get)
    print(f"p={stages} m={m} {overrides}: weights after {STEPS} Adam steps, worst "
          f"{errors[worst]:.1e} ({worst})")
    assert errors[worst] < 1e-5, (worst, errors[worst])
    assert relative(ref_paths["encoder_0/ffn/inner/kernel"], initial) > 1e-3  # trained
    assert pipeline.evaluate(x, y, batch_size=BATCH, verbose=0) == pytest.approx(
        ref.evaluate(x, y, batch_size=BATCH, verbose=0), rel=1e-5)


def test_a_pipelined_moe_transformer_equals_one_device_accumulating_its_micro_batches():
    """MoE blocks add their load-balancing loss per call, and route within the
    tokens they see (capacity per group): a step is one device running the same
    micro-batches one after the other, each micro-batch's loss (cross-entropy
    and auxiliary) weighted by its share of the batch's real tokens, the
    gradients summed, one Adam update. The reference is that loop, written here
    with a `GradientTape` over the one-device `Transformer`."""
    keras.utils.set_random_seed(9)
    length, m = 8, 3
    config = TransformerConfig(vocab_size=V, d_model=16, num_heads=2, d_kv=8, d_ff=32,
                               num_encoder_layers=2, num_decoder_layers=2, max_length=16,
                               dropout=0.0, moe_experts=4, moe_top_k=2, moe_group_size=8,
                               moe_aux_loss_coef=0.1)
    plan = PipelinePlan.from_mesh("stage:2", "layers:stage", num_layers=4, num_microbatches=m,
                                  global_batch=BATCH)
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i + 1}" for i in range(2)]
    pipeline = Pipeline(transformer_stages(config, plan), devices=devices, schedule="1f1b",
                        num_microbatches=m, input_shape=((length,), (length,)),
                        input_dtype=("int32", "int32"))
    weights = transformer_weights(pipeline.stages)
    ref, ref_paths = _one_device_copy(config, weights)
    router = next(path for path in ref_paths if "router" in path)
    router_initial = ref_paths[router].numpy()

    (src, dec), tgt = _batches(STEPS, seed=3, LS=length, LT=length)
    loss = SequenceCrossentropy(V)
    pipeline.compile(keras.optimizers.Adam(1e-2), loss)
    history = pipeline.fit((src, dec), tgt, batch_size=BATCH, shuffle=False, verbose=0)

    optimizer = keras.optimizers.Adam(1e-2)
    variables = ref.trainable_variables
    ref_losses = []
    for step in range(STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        parts = np.array_split(np.arange(BATCH), m)  # sizes 4, 3, 3: as the pipeline's
        tokens = np.count_nonzero(tgt[rows])
        total, step_loss = [tf.zeros_like(v) for v in variables], 0.0
        for part in parts:
            s, d, t = src[rows][part], dec[rows][part], tgt[rows][part]
            with tf.GradientTape() as tape:
                logits = ref((s, d), training=True)
                value = (loss(t, logits) + tf.add_n(ref.losses)) * (
                    np.count_nonzero(t) / tokens)
            total = [a + tf.convert_to_tensor(g) for a, g in
                     zip(total, tape.gradient(value, variables))]
            step_loss += float(value)
        optimizer.apply_gradients(zip(total, variables))
        ref_losses.append(step_loss)
    assert history.history["loss"][0] == pytest.approx(np.mean(ref_losses), rel=1e-5)
    errors = {path: relative(weights[path], v) for path, v in ref_paths.items()}
    worst = max(errors, key=errors.get)
    print(f"MoE p=2 m={m}: weights after {STEPS} Adam steps, worst {errors[worst]:.1e} "
          f"({worst})")
    assert errors[worst] < 1e-5, (worst, errors[worst])
    assert relative(ref_paths[router], router_initial) > 1e-3  # the routers trained
    assert float(tf.add_n(ref.losses)) > 1e-3  # the auxiliary losses are in the step


def test_a_transformer_that_does_not_split_is_one_clear_error():
    config = TransformerConfig(vocab_size=V, d_model=16, num_heads=2, d_kv=8, d_ff=32,
                               num_encoder_layers=2, num_decoder_layers=1)
    plan = PipelinePlan.from_mesh("stage:2", "layers:stage", num_layers=4, num_microbatches=2)
    with pytest.raises(ValueError, match=r"The plan splits 4 layers but the Transformer has 2 "
                                         r"encoder \+ 1 decoder blocks = 3"):
        transformer_stages(config, plan)
    with pytest.raises(ValueError, match=r"num_layers=3 does not split over mesh axis stage:2"):
        PipelinePlan.from_mesh("stage:2", "layers:stage", num_layers=3, num_microbatches=2)


def test_config_round_trip_and_weights_saved_and_loaded(tmp_path):
    config = TransformerConfig(vocab_size=V, d_model=16, num_heads=2, d_kv=8, d_ff=32,
                               num_encoder_layers=2, num_decoder_layers=2, max_length=16,
                               dropout=0.0)
    plan = PipelinePlan.from_mesh("stage:2", "layers:stage", num_layers=4, num_microbatches=2)
    devices = ["/job:localhost/replica:0/task:0/device:CPU:1",
               "/job:localhost/replica:0/task:0/device:CPU:2"]
    model = pipelined_transformer(config, plan, devices, LS, LT)
    model.save_weights(tmp_path / "p.weights.h5")
    again = TransformerPipeline.from_config(model.get_config())
    assert again.model_config == config and len(again.stages) == 2
    assert again.schedule_name == "1f1b" and again.num_microbatches == 2
    again.load_weights(tmp_path / "p.weights.h5")
    x, _ = _batches(1)
    np.testing.assert_array_equal(again.predict(x, verbose=0), model.predict(x, verbose=0))
    # translate runs on a one-device copy of the current weights
    assert model.translate(x[0][:2], beam_size=1, max_length=6, jit_compile=False).shape == (2, 6)
