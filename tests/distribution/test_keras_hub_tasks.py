"""keras-hub task models with their preprocessors, on raw strings: equal to one device.

A `GemmaCausalLM` with its `GemmaCausalLMPreprocessor` (a `GemmaTokenizer`
on a SentencePiece model trained here) runs `fit`, `evaluate`, `predict` and
greedy `generate` on raw strings, keras-hub mapping the preprocessor over the
tf.data pipeline that tfdist distributes, and gives one device's losses,
weights, outputs and text. tests/jobs/job_cases.py runs the same
comparison over two worker processes (`keras_hub_causal_lm`).
"""

import functools
import io

import keras
import keras_hub
import numpy as np
import pytest
import sentencepiece

import tfdist.distribution as td
from tfdist.testing.equivalence import max_rel_diff

WORDS = ("the quick brown fox jumped over a lazy dog cat sat on mat and ran far away "
         "big red sun").split()  # 20 words and 4 special pieces: a vocabulary of 24
LENGTH, BATCH = 16, 8
# Each ends in a partial batch, which reaches the replicas unevenly (30 rows:
# 6 in the last batch, 2, 2, 1 and 1 of them on the 2x2 mesh).
TRAIN_ROWS, EVAL_ROWS, PREDICT_ROWS = 30, 12, 10
PROMPTS = ["the quick", "a cat sat"]
# Adam turns rounding noise on near-zero gradients into full-size steps: weights
# are compared by relative L2 per weight, not by their largest element.
RTOL = 1e-5


def sentences(n, seed):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 10))) for _ in range(n)]


@functools.lru_cache(maxsize=None)
def spm_proto() -> bytes:
    """A word-level SentencePiece model with Gemma's special pieces."""
    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences(64, seed=0)), model_writer=proto,
        vocab_size=len(WORDS) + 4, model_type="WORD", minloglevel=2,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>")
    return proto.getvalue()


def causal_lm():
    """A compiled tiny `GemmaCausalLM` with its preprocessor, greedy sampling."""
    tokenizer = keras_hub.models.GemmaTokenizer(proto=spm_proto())
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(tokenizer, sequence_length=LENGTH)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), num_layers=1, num_query_heads=4,
        num_key_value_heads=2, hidden_dim=32, intermediate_dim=64, head_dim=8)
    model = keras_hub.models.GemmaCausalLM(backbone, preprocessor)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), sampler="greedy")
    return model


def run(model):
    """`fit` for one epoch, `evaluate`, `predict` and `generate`, all on raw strings."""
    history = model.fit(sentences(TRAIN_ROWS, seed=1), batch_size=BATCH, shuffle=False,
                        verbose=0)
    return dict(
        loss=np.asarray(history.history["loss"]),
        weights=model.get_weights(),
        evaluate=np.asarray(model.evaluate(sentences(EVAL_ROWS, seed=2), batch_size=BATCH,
                                           verbose=0)),
        predict=model.predict(sentences(PREDICT_ROWS, seed=3), batch_size=BATCH, verbose=0),
        generate=model.generate(PROMPTS, max_length=LENGTH),
    )


def run_reference():
    """The initial weights and `run`'s results of the model on one device."""
    keras.utils.set_random_seed(0)
    model = causal_lm()
    initial = model.get_weights()
    return initial, run(model)


def relative_l2(actual, expected) -> float:
    expected = np.asarray(expected, np.float64)
    return float(np.linalg.norm(np.asarray(actual, np.float64) - expected)
                 / np.linalg.norm(expected))


def assert_matches_one_device(strategy, reference) -> dict:
    """Runs the model under `strategy` from the reference's initial weights;
    returns the differences (asserted within `RTOL`, and the same text)."""
    initial, expected = reference
    with strategy.scope():
        model = causal_lm()
        model.set_weights(initial)
    actual = run(model)
    report = {key: max_rel_diff(actual[key], expected[key])
              for key in ("loss", "evaluate", "predict")}
    assert len(actual["weights"]) == len(expected["weights"])
    report["weights"] = max(relative_l2(a, b)
                            for a, b in zip(actual["weights"], expected["weights"]))
    assert actual["generate"] == expected["generate"], (actual["generate"],
                                                        expected["generate"])
    assert all(value <= RTOL for value in report.values()), report
    report["generate"] = actual["generate"]
    return report


def gemma_model_parallel(shape, devices):
    """`ModelParallel` with Gemma's layout map over a (batch, model) mesh of `devices`."""
    mesh = td.DeviceMesh(shape, ("batch", "model"), devices)
    return td.ModelParallel(layout_map=keras_hub.models.GemmaBackbone.get_layout_map(mesh),
                            batch_dim_name="batch")


@pytest.fixture(scope="module")
def reference():
    return run_reference()


STRATEGIES = {
    "model_parallel_2x2": lambda: gemma_model_parallel((2, 2), [f"cpu:{i}" for i in range(4)]),
    "data_parallel_2": lambda: td.DataParallel(devices=["cpu:0", "cpu:1"]),
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_causal_lm_with_its_preprocessor_on_raw_strings_matches_one_device(name, reference):
    report = assert_matches_one_device(STRATEGIES[name](), reference)
    print(f"{name}: {report}")
