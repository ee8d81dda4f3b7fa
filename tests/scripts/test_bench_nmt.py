"""bench/nmt.py --quick runs end to end and prints its table (no timing is checked)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_quick_run_prints_the_table_and_summary():
    # XLA on: the same functions with jit_compile (its compile time is the suite's budget).
    result = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "nmt.py"), "--quick",
                             "--xla=off"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "| measure | XLA | tfdist | keras-hub | tfdist/keras-hub | target |" in result.stdout
    for row in ("| training tokens/s | off |", "| beam-4 sentences/s | off |"):
        assert row in result.stdout
    assert "summary: training tfdist/keras-hub" in result.stdout


def _nmt_buckets():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "nmt_buckets", os.path.join(ROOT, "bench", "nmt_buckets.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bucket_bench_ideal_ratio_and_flops_by_hand():
    import numpy as np

    from tfdist.config import TransformerConfig

    bench = _nmt_buckets()
    # Lengths 5, 9, 16 in buckets of 8: 8 + 16 + 16 positions; one bucket of 24: 72.
    assert bench.padded_positions([5, 9, 16], 24, 8) == 40
    assert bench.padded_positions([5, 9, 16], 24, 24) == 72
    # One encoder and one decoder layer, d_model 2, one head of 2, d_ff 3, vocab 5, no MoE;
    # one pair: 2 real source tokens, 1 real target token (padding 0 is not counted).
    cfg = TransformerConfig(vocab_size=5, d_model=2, num_heads=1, d_kv=2, d_ff=3,
                            num_encoder_layers=1, num_decoder_layers=1)
    source, target = np.array([[4, 3, 0]]), np.array([[2, 0, 0]])
    encoder = 2 * (4 * 2 * 2 + 2 * 2 * 3) + 2 * 2 * 2 ** 2          # 2 tokens; 2^2 scores
    decoder = 1 * (6 * 2 * 2 + 2 * 2 * 3) + 2 * 2 * 2 * 2 + 2 * 2 * (1 + 2)  # + cross k, v
    logits = 1 * 2 * 5
    assert bench.batch_train_flops(cfg, source, target) == 6 * (encoder + decoder + logits)
