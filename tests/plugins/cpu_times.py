"""Per-test CPU seconds, for finding where the suite's time goes under load.

    PYTHONPATH=tests/plugins PYTEST_ADDOPTS='-p cpu_times' make test

Each pytest process (every xdist worker) appends one line per test to
`$TFDIST_CPU_TIMES_DIR/<pid>.tsv` (default /tmp/tfdist_cpu_times): node id,
start (s since the plugin loaded in that process), CPU seconds of the process, CPU
seconds of its waited-for children (launched jobs), wall seconds. Wall far
above CPU means the test waited (for the cores, or for a peer).
"""

import os
import resource
import time

import pytest

_DIR = os.environ.get("TFDIST_CPU_TIMES_DIR", "/tmp/tfdist_cpu_times")
_START = time.monotonic()
os.makedirs(_DIR, exist_ok=True)


def _cpu():
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    (own, children), start = _cpu(), time.monotonic()
    yield
    (own_end, children_end), end = _cpu(), time.monotonic()
    with open(os.path.join(_DIR, f"{os.getpid()}.tsv"), "a") as out:
        out.write(f"{item.nodeid}\t{start - _START:.1f}\t{own_end - own:.1f}\t"
                  f"{children_end - children:.1f}\t{end - start:.1f}\n")
