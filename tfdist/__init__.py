"""tfdist: Keras 3 / TensorFlow distribution toolkit (meshes, sharded layers, strategies).

The main names are importable from here and load on first use, so
`import tfdist` costs nothing (TensorFlow is imported only when a name that
needs it is used; `Mesh`, `MeshShape` and `LayoutRules` never need it):

    import tfdist

    mesh = tfdist.Mesh.parse("data:2;model:2", "batch:data;d_ff:model")
    strategy = tfdist.get_strategy("mesh", mesh_shape="data:2;model:2",
                                   layout="batch:data;d_ff:model")
    with strategy.scope():
        layer = tfdist.ShardedDense(64, kernel_axes=("d_model", "d_ff"))

`HorovodStrategy` needs a Horovod build (`make horovod`); the others do not.
"""

import importlib
import importlib.util
import pkgutil

__version__ = "0.1.0"

# name -> the module that defines it.
_EXPORTS = {
    # the mesh and layout language (pure Python)
    "Mesh": "tfdist.mesh",
    "MeshShape": "tfdist.mesh",
    "LayoutRules": "tfdist.mesh",
    "TensorLayout": "tfdist.mesh",
    # strategies
    "get_strategy": "tfdist.strategies",
    "STRATEGY_NAMES": "tfdist.strategies",
    "MeshStrategy": "tfdist.strategies",
    "MultiWorkerStrategy": "tfdist.strategies",
    "ModelAveragingStrategy": "tfdist.strategies",
    "HorovodStrategy": "tfdist.strategies",
    # any Keras / keras-hub model, split by a keras.distribution LayoutMap
    "ModelParallel": "tfdist.distribution",
    "DataParallel": "tfdist.distribution",
    # layers
    "MoE": "tfdist.layers",
    "ShardedAttention": "tfdist.layers",
    "ShardedDense": "tfdist.layers",
    "ShardedEmbedding": "tfdist.layers",
    "ShardedSoftmax": "tfdist.layers",
    "ShardedSparseCategoricalCrossentropy": "tfdist.layers",
    "ShardedTopK": "tfdist.layers",
    "ShardedTopKAccuracy": "tfdist.layers",
    "add_sharded_weight": "tfdist.layers",
    # models
    "Transformer": "tfdist.models",
    "TransformerConfig": "tfdist.models",
    "build_token_mlp": "tfdist.models",
    # activation recomputation
    "remat": "tfdist.recompute",
    # the layout planner
    "plan": "tfdist.planner",
    # virtual CPU devices (a laptop, tests, demos)
    "split_cpu": "tfdist.devices",
}

# `from tfdist import *` gives everything but HorovodStrategy (it needs a Horovod build).
__all__ = sorted(name for name in _EXPORTS if name != "HorovodStrategy")


def _submodules():
    return sorted(info.name for info in pkgutil.iter_modules(__path__))


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:  # `tfdist.layers` etc.
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(
            f"module 'tfdist' has no attribute {name!r}; its names are {sorted(_EXPORTS)} "
            f"and its submodules {_submodules()}.")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | set(_submodules()))
