"""Runs the absl entry points in scripts/ as a user would, in a subprocess."""

import json
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


@pytest.fixture
def calibrated(tmp_path, monkeypatch):
    """This machine's calibration cache in `tmp_path`, with in-process collectives far
    dearer than the update of a weight: the planner's pick is data parallelism."""
    from tfdist.planner import Calibration
    from tfdist.planner.probe import cache_path

    monkeypatch.setenv("TFDIST_PLANNER_CACHE", str(tmp_path))
    colls = {(k, n): (1e-2, 1e-9) for k in ("all_reduce", "all_gather", "reduce_scatter",
                                            "all_to_all") for n in (2, 4)}
    with open(cache_path(), "w") as f:
        json.dump(Calibration({2: 1e10, 4: 1e10}, colls, {2: 1e-3, 4: 1e-3},
                              {2: 1e-9, 4: 1e-9}).to_json(), f)
