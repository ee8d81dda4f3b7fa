"""keras-hub causal LMs cut between their backbone's decoder blocks train like the model itself.

The reference is the keras-hub `CausalLM` itself, trained by Keras's `fit` on
one device (no tfdist code); the pipeline is `Pipeline.from_model(lm,
split_at=...)`: the backbone inlined, cut after the named decoder blocks, the
padding mask travelling along with the hidden states, the token embedding on
the first stage (Gemma's LM head is the same table: its gradient is the sum of
both stages'; Llama's untied head is a second weight of the same layer).
Compared: logits, the loss of each step, and every weight after 10 Adam steps
over batches with padding (sample weights = the padding mask).
"""

import keras
import numpy as np
import pytest

keras_hub = pytest.importorskip("keras_hub")

from tfdist.pipeline.model import Pipeline  # noqa: E402
from tfdist.testing.pipeline import relative  # noqa: E402

VOCAB, LENGTH, ROWS, BATCH = 48, 8, 50, 10


def _cpus(count, first=1):
    return [f"/job:localhost/replica:0/task:0/device:CPU:{i + first}" for i in range(count)]


def _gemma():
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB, num_layers=4, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, head_dim=8)
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def _llama():
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=4, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32)
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def _data():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, (ROWS, LENGTH + 1)).astype("int32")
    mask = np.ones((ROWS, LENGTH), "int32")
    for r, n in enumerate(rng.integers(3, LENGTH + 1, ROWS)):  # padded rows
        mask[r, n:] = 0
        ids[r, n:] = 0
    x = {"token_ids": ids[:, :-1], "padding_mask": mask}
    return x, ids[:, 1:], mask.astype("float32")


def _compile(model):
    keras.Model.compile(model, keras.optimizers.Adam(1e-3),
                        keras.losses.SparseCategoricalCrossentropy(from_logits=True))


@pytest.mark.parametrize("make,after,schedule,m,grid", [
    (_gemma, [1], "1f1b", 3, False),
    (_llama, [0, 2], "gpipe", 4, False),
    (_gemma, [1], "1f1b", 2, True),      # stage x data: 2 x 2 devices
])
def test_causal_lm_cut_between_decoder_blocks_trains_like_the_model(make, after, schedule,
                                                                   m, grid):
    keras.utils.set_random_seed(5)
    lm = make()  # on CPU:0
    blocks = [layer.name for layer in lm.backbone.transformer_layers]
    split_at = [blocks[j] for j in after]  # Gemma: decoder_block_j, Llama: transformer_layer_j
    p = len(split_at) + 1
    cpus = _cpus(2 * p if grid else p)
    devices = [tuple(cpus[s::p]) for s in range(p)] if grid else cpus
    pipeline = Pipeline.from_model(lm, split_at, devices=devices, schedule=schedule,
                                   num_microbatches=m)
    first = [d if isinstance(d, str) else d[0] for d in devices]
    cut = [0] + [j + 1 for j in after] + [4]
    for k, stage in enumerate(pipeline.stages):
        names = [layer.name for layer in stage.layers]
        assert [n for n in names if n in blocks] == blocks[cut[k]:cut[k + 1]]
        own = [w for w in stage.weights if not w.path.startswith("token_embedding")]
        assert {w.value.device for w in own} == {first[k]}, k  # its blocks on its device
    assert {w.value.device for w in pipeline.stages[0].weights
            if w.path.startswith("token_embedding")} == {first[0]}
    assert any(w.path.startswith("token_embedding") for w in pipeline.stages[-1].weights)

    x, y, weights = _data()
    np.testing.assert_allclose(pipeline.predict(x, batch_size=BATCH, verbose=0),
                               lm.predict(x, batch_size=BATCH, verbose=0), rtol=1e-5, atol=1e-5)
    initial = {w.path: w.numpy() for w in lm.weights}
    _compile(pipeline)
    _compile(lm)
    ours = pipeline.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=2, shuffle=False,
                        verbose=0).history["loss"]
    theirs = lm.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=2, shuffle=False,
                    verbose=0).history["loss"]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    trained = {w.path: w for stage in pipeline.stages for w in stage.weights}
    assert sorted(trained) == sorted(w.path for w in lm.weights)
    worst = 0.0
    for w in lm.weights:
        assert relative(w.numpy(), initial[w.path]) > 1e-3, w.path  # every weight trained
        error = relative(trained[w.path].numpy(), w.numpy())
        assert error < 1e-5, (w.path, error)
        worst = max(worst, error)
    print(f"{lm.name}: worst weight error {worst:.1e} after {len(ours) * ROWS // BATCH} steps")


def test_weights_go_to_and_come_from_the_unpipelined_model(tmp_path):
    """One checkpoint of global tensors: the pipeline's weights saved through the
    keras-hub model (loadable by any mesh, pipelined or not) and loaded back."""
    keras.utils.set_random_seed(8)
    lm = _gemma()
    pipeline = Pipeline.from_model(lm, ["decoder_block_1"], devices=_cpus(2),
                                   num_microbatches=2)
    for v in pipeline.weights_by_path().values():  # weights of the pipeline's own
        v.assign(v + 0.01)
    other = _gemma()
    pipeline.assign_weights_to(other)
    other.save_weights(tmp_path / "lm.weights.h5")
    again = _gemma()
    again.load_weights(tmp_path / "lm.weights.h5")
    x, _, _ = _data()
    np.testing.assert_allclose(again.predict(x, verbose=0), pipeline.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-5)
    fresh = Pipeline.from_model(_gemma(), ["decoder_block_2"], devices=_cpus(2),
                                num_microbatches=3)
    fresh.assign_weights_from(again)
    np.testing.assert_allclose(fresh.predict(x, verbose=0), pipeline.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"does not hold the pipeline's weights"):
        pipeline.assign_weights_to(_llama())
