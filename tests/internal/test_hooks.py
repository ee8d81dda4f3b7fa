"""tfdist.internal.hooks: every upstream hook in one table, checked against the installed
TF / Keras / keras-hub, and a strategy refusing to start where one moved."""

import ast
import dataclasses
import importlib
import os
import pathlib
import pkgutil
import re
import subprocess
import sys
import types

import keras
import pytest

import tfdist
import tfdist.distribution as td
from tfdist import check as check_cli
from tfdist.internal import hooks, keras_hub_attention, keras_initial_slices
from tfdist.strategies import MeshStrategy, ModelAveragingStrategy, MultiWorkerStrategy

ROOT = pathlib.Path(__file__).resolve().parents[2]
UPSTREAM = tuple(hooks.SUPPORTED_VERSIONS)


@pytest.fixture
def recheck():
    """`hooks.check()` computed afresh within the test, and again after it."""
    hooks._checked.cache_clear()
    yield
    hooks._checked.cache_clear()


def _install_every_hook():
    MeshStrategy("data:2")  # the Keras hooks
    mesh = td.DeviceMesh((1, 2), ("batch", "model"), ["cpu:0", "cpu:1"])
    td.ModelParallel(layout_map=td.LayoutMap(mesh), batch_dim_name="batch")  # the layout hooks


# -- the table ---------------------------------------------------------------------------


def test_every_hook_matches_the_installed_packages(recheck):
    statuses = hooks.check()
    assert [s.hook for s in statuses] == list(hooks.HOOKS)
    assert [(s.hook.target, s.status, s.detail) for s in statuses if s.status != hooks.OK] == []
    hooks.verify()


def test_every_hook_still_matches_once_tfdist_replaced_it(recheck):
    # Replaced attributes are tfdist's functions now: the originals they keep are checked.
    _install_every_hook()
    statuses = hooks.check()
    assert [(s.hook.target, s.status, s.detail) for s in statuses if s.status != hooks.OK] == []
    for status in statuses:
        if status.hook.kind == "replaced":
            assert not hooks._defined_in_tfdist(hooks.upstream_function(status.hook)), \
                status.hook.target


def test_the_entries_are_well_formed():
    # An attribute may be set on instances and its logic mirrored: two entries, two kinds.
    targets = [(h.target, h.kind) for h in hooks.HOOKS]
    assert len(targets) == len(set(targets))
    for hook in hooks.HOOKS:
        assert hook.target.split(".")[0] == hook.package, hook.target
        assert (hook.source or hook.package).split(".")[0] == hook.package, hook.target
        assert hook.sha256 is None or re.fullmatch("[0-9a-f]{64}", hook.sha256), hook.target
        for module in hook.modules:
            assert importlib.util.find_spec(module) is not None, (hook.target, module)
        for test in hook.tests:
            assert (ROOT / test).is_file(), (hook.target, test)
        assert (hook.kind == "set") == (hook.source is not None), hook.target
        if hook.original is not None:
            assert hook.kind == "replaced", hook.target
            MeshStrategy("data:1")  # installs the hooks (else this depends on earlier tests)
            hooks._resolve(hook.original)  # the module keeps it there
        if hook.sha256 is None:
            hooks._resolve(hook.target)  # checked by its tests; it must exist


def test_the_modules_own_fingerprints_are_the_tables():
    table = {h.target: h.sha256 for h in hooks.HOOKS}
    for (module, name), digest in keras_initial_slices.SOURCES.items():
        assert table[f"{module}.{name}"] == digest, name
    for (module, name), (_, _, methods, _) in keras_hub_attention.SOURCES.items():
        for method, digest in methods.items():
            assert table[f"{module}.{name}.{method}"] == digest, (name, method)


# -- the table is complete -----------------------------------------------------------------


def _in_tfdist(function) -> bool:
    return isinstance(function, types.FunctionType) and hooks._defined_in_tfdist(function)


def _function_of(value):
    if isinstance(value, (staticmethod, classmethod)):
        return value.__func__
    if isinstance(value, property):
        return value.fget
    return value


def _patched_upstream_attributes():
    """Dotted paths of the upstream module and class attributes that are tfdist functions."""
    found = set()
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] not in UPSTREAM or not isinstance(module, types.ModuleType):
            continue
        for attr, value in list(vars(module).items()):
            if _in_tfdist(value):
                found.add(f"{name}.{attr}")
            elif isinstance(value, type) and value.__module__ == name:
                for class_attr, class_value in list(vars(value).items()):
                    if _in_tfdist(_function_of(class_value)):
                        found.add(f"{name}.{value.__qualname__}.{class_attr}")
    return found


def test_every_upstream_attribute_tfdist_replaced_is_in_the_table():
    _install_every_hook()
    replaced = {h.target for h in hooks.HOOKS if h.kind == "replaced"}
    assert _patched_upstream_attributes() == replaced


_NOT_OVERRIDES = {"__init__", "__module__", "__doc__", "__qualname__", "__dict__", "__weakref__",
                  "__annotations__", "__firstlineno__", "__static_attributes__", "__slots__",
                  "__abstractmethods__", "__parameters__", "__orig_bases__", "_abc_impl"}


def _tfdist_modules():
    for info in pkgutil.walk_packages(tfdist.__path__, "tfdist."):
        try:
            yield importlib.import_module(info.name)
        except ImportError:  # needs an optional package (Horovod)
            continue


def _overridden_upstream_attributes():
    """`upstream class.attribute` for each attribute a tfdist subclass of a TF / Keras /
    keras-hub class overrides: any in `tfdist.internal`, private ones elsewhere (public
    methods of public classes, `call` or `reduce`, are meant to be overridden)."""
    found = set()
    for module in _tfdist_modules():
        for cls in vars(module).values():
            if not isinstance(cls, type) or cls.__module__ != module.__name__:
                continue
            upstream = [b for b in cls.__mro__ if b.__module__.split(".")[0] in UPSTREAM]
            if not upstream:
                continue
            ours = [b for b in cls.__mro__ if b.__module__.startswith("tfdist.")]
            internal = module.__name__.startswith("tfdist.internal.")
            for attr in set().union(*(vars(b) for b in ours)) - _NOT_OVERRIDES:
                private = attr.startswith("_") and not attr.startswith("__")
                if (internal or private) and any(attr in vars(b) for b in upstream):
                    found.add(f"{upstream[0].__module__}.{upstream[0].__qualname__}.{attr}")
    return found


def test_every_upstream_attribute_a_tfdist_subclass_overrides_is_in_the_table():
    overridden = {h.target for h in hooks.HOOKS if h.kind == "overridden"}
    assert _overridden_upstream_attributes() == overridden


# Attribute assignments in tfdist/ to objects other than `self` that are not hooks.
_NOT_HOOKS = {
    "tfdist/comm/tf_collectives.py: TFCollectiveBackend._next_instance_base": "tfdist's class",
    "tfdist/layers/weights.py: layer.weight_layouts": "tfdist's own attribute of a layer",
    "tfdist/layers/weights.py: layer.supports_jit": "Keras's public Layer attribute",
    "tfdist/weight_reads.py: setattr(_state, kind)": "a thread-local",
    "tfdist/testing/collective_log.py: setattr(backend, collective)": "tfdist's backend",
    "tfdist/internal/keras_h5_slices.py: setattr(owner, name)":
        "its three replaced attributes (found by the scan of upstream attributes)",
    **{f"tfdist/testing/moe_reference.py: layer.{w}": "a test layer's weight"
       for w in ("router", "wi", "wo", "shared_wi", "shared_wo")},
}


def _attribute_assignments():
    """'path: object.attribute' of each attribute assignment (and `setattr`,
    `object.__setattr__`) in tfdist/,
    but to `self`, a thread-local (`_local`, `_state`) or a `_tfdist*` attribute."""
    found = set()
    for path in sorted((ROOT / "tfdist").rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in (
                    "setattr", "object.__setattr__"):
                name = node.args[1]
                if ast.unparse(node.args[0]) == "self":
                    pass  # its own attribute (a frozen dataclass's)
                elif isinstance(name, ast.Constant) and not name.value.startswith("_tfdist"):
                    found.add(f"{where}: {ast.unparse(node.args[0])}.{name.value}")
                elif not isinstance(name, ast.Constant):
                    found.add(f"{where}: setattr({ast.unparse(node.args[0])}, "
                              f"{ast.unparse(name)})")
                continue
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if (isinstance(t, ast.Attribute) and ast.unparse(t.value) not in
                            ("self", "_local", "_state") and not t.attr.startswith("_tfdist")):
                        found.add(f"{where}: {ast.unparse(t)}")
    return found


def test_every_attribute_tfdist_assigns_upstream_is_in_the_table():
    # An instance's attribute (a model's `_initial_epoch`) escapes the scans above:
    # each assignment in tfdist/ names an attribute of the table, or is not a hook.
    attributes = {h.target.rsplit(".", 1)[1] for h in hooks.HOOKS}
    unlisted = sorted(a for a in _attribute_assignments() - set(_NOT_HOOKS)
                      if a.rsplit(".", 1)[1] not in attributes)
    assert unlisted == []
    assert set(_NOT_HOOKS) <= _attribute_assignments()  # nothing stale


# -- a moved upstream ----------------------------------------------------------------------


def _moved_keras(monkeypatch, supported="3.14.0"):
    """`HOOKS` as written for another Keras: its first hook's source differs."""
    moved = dataclasses.replace(hooks.HOOKS[0], sha256="0" * 64)
    assert moved.package == "keras"
    monkeypatch.setattr(hooks, "HOOKS", (moved,) + hooks.HOOKS[1:])
    monkeypatch.setattr(hooks, "SUPPORTED_VERSIONS", {**hooks.SUPPORTED_VERSIONS,
                                                      "keras": supported})
    return re.escape(
        f"tfdist {tfdist.__version__} supports keras {supported} (installed: "
        f"{keras.__version__}): its hooks into {moved.target} no longer match the installed "
        f"source. Install keras=={supported}, or run `python -m tfdist.check` for the full "
        f"report.")


def test_a_moved_source_makes_verify_raise_naming_the_package_and_versions(monkeypatch, recheck):
    message = _moved_keras(monkeypatch)
    assert [s.status for s in hooks.check()].count(hooks.MOVED) == 1
    with pytest.raises(hooks.UpstreamMismatchError, match=f"^{message}$"):
        hooks.verify()


def test_every_strategy_refuses_to_start_on_a_moved_source(monkeypatch, recheck):
    from tfdist.strategies.horovod import HorovodStrategy

    message = _moved_keras(monkeypatch)
    mesh = td.DeviceMesh((1, 2), ("batch", "model"), ["cpu:0", "cpu:1"])
    for make in (lambda: MeshStrategy("data:2"),
                 lambda: td.ModelParallel(layout_map=td.LayoutMap(mesh)),
                 lambda: ModelAveragingStrategy(period=2, devices=["cpu:0", "cpu:1"]),
                 lambda: MultiWorkerStrategy(),
                 lambda: HorovodStrategy()):
        with pytest.raises(hooks.UpstreamMismatchError, match=message):
            make()


def test_a_missing_target_and_an_absent_optional_package(monkeypatch, recheck):
    first = next(h for h in hooks.HOOKS if h.package == "keras" and h.source is None)
    keras_hook = dataclasses.replace(first, target=first.target + "_renamed")
    hub_hook = next(h for h in hooks.HOOKS if h.package == "keras_hub")
    monkeypatch.setattr(hooks, "HOOKS", (keras_hook, hub_hook))
    assert [s.status for s in hooks.check()] == [hooks.MISSING, hooks.OK]
    with pytest.raises(hooks.UpstreamMismatchError,
                       match=re.escape(f"{keras_hook.target} no longer exists.")):
        hooks.verify()
    monkeypatch.setattr(hooks, "is_installed", lambda package: package != "keras_hub")
    hooks._checked.cache_clear()
    assert [s.status for s in hooks.check()] == [hooks.MISSING, hooks.SKIPPED]
    with pytest.raises(hooks.UpstreamMismatchError) as raised:
        hooks.verify()
    assert "keras_hub" not in str(raised.value)  # an optional package, not installed


# -- python -m tfdist.check, and the docs ----------------------------------------------------


def test_python_m_tfdist_check_prints_one_line_per_hook_and_exits_0():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    run = subprocess.run([sys.executable, "-m", "tfdist.check"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == len(hooks.HOOKS) + 1
    for line, hook in zip(lines, hooks.HOOKS):
        assert line.startswith(f"ok       {hook.target}  [{hook.kind}; "), line
    assert lines[-1].startswith(f"{len(hooks.HOOKS)} upstream hooks: {len(hooks.HOOKS)} ok.")


def test_the_check_exits_1_with_the_error_on_a_moved_source(monkeypatch, recheck, capsys):
    message = _moved_keras(monkeypatch)
    assert check_cli.main([]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"moved    {hooks.HOOKS[0].target}")
    assert re.fullmatch(message, lines[-1])


def test_the_docs_table_is_the_hooks_table():
    doc = (ROOT / "docs" / "upstream_hooks.md").read_text()
    assert hooks.markdown_table() in doc, (
        "docs/upstream_hooks.md is out of date: paste `python -m tfdist.check --markdown`")
    kinds = [h.kind for h in hooks.HOOKS]
    patched = sum(kinds.count(k) for k in ("replaced", "overridden", "set"))
    assert (f"{len(kinds)} hooks, of which {patched} patch or override upstream code "
            f"({kinds.count('replaced')} replaced, {kinds.count('overridden')} overridden, "
            f"{kinds.count('set')} set) and {len(kinds) - patched} mirror or rely on upstream "
            f"source") in " ".join(doc.split())
    for package, version in hooks.SUPPORTED_VERSIONS.items():
        assert f"{hooks.PIP_NAMES[package]} {version}" in " ".join(doc.split())
