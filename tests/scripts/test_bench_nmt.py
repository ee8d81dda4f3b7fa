"""bench/nmt.py --quick runs end to end and prints its table (no timing is checked)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_quick_run_prints_the_table_and_summary():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "nmt.py"), "--quick"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "| measure | XLA | tfdist | keras-hub | tfdist/keras-hub | target |" in result.stdout
    for row in ("| training tokens/s | off |", "| training tokens/s | on |",
                "| beam-4 sentences/s | off |", "| beam-4 sentences/s | on |"):
        assert row in result.stdout
    assert "summary: training tfdist/keras-hub" in result.stdout
