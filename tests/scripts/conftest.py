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


@pytest.fixture
def assert_one_line_error():
    return _assert_one_line_error


def _assert_one_line_error(result, fragment):
    """Bad input: exit status 2 and one line on stderr, `<script>: error: ...` naming it."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert len(lines) == 1 and ": error: " in lines[0], result.stderr[-2000:]
    assert fragment in lines[0], lines[0]
