"""The README's "bring your Keras / keras-hub model" snippet runs as written."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _snippet():
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("**Bring your Keras / keras-hub model.**"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_bring_your_model_snippet_runs_as_written():
    code = _snippet()
    assert "tfdist.distribution.ModelParallel(layout_map=layout_map" in code
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Epoch 2/2" in result.stdout
