"""Our parser against Mesh-TensorFlow's own, when mesh-tensorflow is installed.

mesh-tensorflow 0.1.21 imports on TF 2.21 only with two shims and only in TF1
graph mode, so it runs in a subprocess (graph mode would leak into other tests):
1. `tensorflow.compat.v1.estimator` no longer exists: a stub module whose
   attributes are empty classes (mtf subclasses `CheckpointSaverListener`);
2. `tensorflow.python.framework.ops.register_tensor_conversion_function`
   moved to `tensor_conversion_registry`: an alias.
"""

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

from tfdist.mesh import LayoutRules, MeshShape

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mesh_tensorflow") is None,
    reason="mesh-tensorflow is not installed",
)

SHAPES = ["data:2;model:4", "rows:2,cols:4", "a:1.b:2 c:3", "x:8", " b:2 ;, m:2 "]
LAYOUTS = ["batch:data;d_ff:model;heads:model", "batch:rows,d_ff:cols.vocab:cols",
           "experts:model classes:data", ""]

ORACLE = textwrap.dedent(
    """
    import json, sys, types
    import tensorflow as tf
    import tensorflow.compat.v1
    from tensorflow.python.framework import ops, tensor_conversion_registry
    stub = types.ModuleType("tensorflow.compat.v1.estimator")
    stub.__getattr__ = lambda name: type(name, (object,), {})
    sys.modules["tensorflow.compat.v1.estimator"] = stub
    sys.modules["tensorflow.compat.v1"].estimator = stub
    ops.register_tensor_conversion_function = (
        tensor_conversion_registry.register_tensor_conversion_function)
    tf.compat.v1.disable_eager_execution()
    import mesh_tensorflow as mtf
    shapes, layouts = json.loads(sys.argv[1])
    print(json.dumps([
        [[[d.name, d.size] for d in mtf.convert_to_shape(s).dims] for s in shapes],
        [sorted(map(list, mtf.convert_to_layout_rules(l)._pairs)) for l in layouts],
    ]))
    """
)


def test_parser_matches_mesh_tensorflow():
    out = subprocess.run(
        [sys.executable, "-c", ORACLE, json.dumps([SHAPES, LAYOUTS])],
        check=True, capture_output=True, text=True, timeout=300,
    ).stdout
    mtf_shapes, mtf_layouts = json.loads(out.strip().splitlines()[-1])
    for spec, expected in zip(SHAPES, mtf_shapes):
        assert [list(a) for a in MeshShape.parse(spec).axes] == expected, spec
    for spec, expected in zip(LAYOUTS, mtf_layouts):
        assert sorted(map(list, LayoutRules.parse(spec).rules)) == expected, spec
