"""Runs the absl entry points in scripts/ as a user would, in a subprocess."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def run_script():
    def run(name, *args, timeout=600):
        return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *args],
                              capture_output=True, text=True, timeout=timeout, cwd=ROOT)

    return run
