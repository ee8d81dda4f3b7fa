"""The public surface: `tfdist.<Name>` and `tfdist.strategies.HorovodStrategy`, loaded lazily.

Import costs are checked in fresh processes (this one has TensorFlow already).
"""

import os
import subprocess
import sys
import textwrap

import pytest

import tfdist
import tfdist.layers
import tfdist.mesh
import tfdist.models
import tfdist.strategies


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_import_tfdist_imports_no_tensorflow_until_a_name_needs_it():
    result = _run("""
        import sys
        import tfdist
        assert "tensorflow" not in sys.modules and "keras" not in sys.modules, "on import"
        mesh = tfdist.Mesh.parse("data:2;model:2", "batch:data;d_ff:model")
        tfdist.MeshShape.parse("data:2"), tfdist.LayoutRules.parse("d_ff:model")
        assert "tensorflow" not in sys.modules, "after the mesh names"
        assert tfdist.ShardedDense.__module__ == "tfdist.layers.dense"
        assert "tensorflow" in sys.modules
        print("OK", mesh.size)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK 4" in result.stdout


def test_every_exported_name_is_the_object_of_its_module():
    for name, module in tfdist._EXPORTS.items():
        if name == "HorovodStrategy":
            continue  # needs a Horovod build: test_horovod_strategy_* below
        assert getattr(tfdist, name) is getattr(sys.modules[module], name), name
    assert set(tfdist.layers.__all__) <= set(tfdist._EXPORTS), "a layer is not exported"
    assert tfdist.get_strategy is tfdist.strategies.get_strategy
    assert tfdist.strategies is sys.modules["tfdist.strategies"]  # submodules still resolve
    assert "ShardedDense" in dir(tfdist) and "HorovodStrategy" in dir(tfdist.strategies)


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(AttributeError, match=r"no attribute 'ShardedDence'; its names are .*"
                                             r"'ShardedDense'"):
        tfdist.ShardedDence  # noqa: B018
    with pytest.raises(AttributeError, match="'tfdist.strategies' has no attribute 'Nope'"):
        tfdist.strategies.Nope  # noqa: B018


def test_import_strategies_imports_no_horovod():
    result = _run("""
        import sys
        import tfdist.strategies
        from tfdist.strategies import *  # noqa: F403
        assert not any(m.split(".")[0] == "horovod" for m in sys.modules), "horovod imported"
        print("OK")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout


def test_horovod_strategy_without_horovod_says_how_to_build_it():
    result = _run("""
        import sys
        sys.modules["horovod"] = None  # `import horovod` fails as if it were not installed
        import tfdist
        from tfdist.strategies import get_strategy
        for get in (lambda: __import__("tfdist.strategies", fromlist=["HorovodStrategy"])
                    .HorovodStrategy,
                    lambda: tfdist.HorovodStrategy,
                    lambda: get_strategy("horovod")):
            try:
                get()
            except ImportError as e:
                print("ImportError:", e)
            else:
                print("NO ERROR")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("ImportError:") for line in lines), lines
    assert all("make horovod" in line and "scripts/install_horovod.sh" in line for line in lines)


@pytest.mark.horovod
def test_horovod_strategy_with_horovod_is_the_strategy_class():
    from tfdist.strategies import HorovodStrategy
    from tfdist.strategies.horovod import HorovodStrategy as defined

    assert HorovodStrategy is defined and tfdist.HorovodStrategy is defined
