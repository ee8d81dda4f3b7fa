"""tf.distribute strategies, chosen by name with `get_strategy`.

`HorovodStrategy` is imported on first use (`from tfdist.strategies import
HorovodStrategy`), so importing this package never imports Horovod; without a
Horovod build that import fails with a message saying how to build one.
"""

from tfdist.strategies.averaging import CommunicationBytes, ModelAveragingStrategy
from tfdist.strategies.mesh_strategy import MeshStrategy
from tfdist.strategies.multi_worker import MultiWorkerStrategy
from tfdist.strategies.registry import STRATEGY_NAMES, get_strategy

_LAZY = ("HorovodStrategy",)

__all__ = ["CommunicationBytes", "MeshStrategy", "ModelAveragingStrategy", "MultiWorkerStrategy",
           "STRATEGY_NAMES", "get_strategy"]  # not HorovodStrategy: `import *` needs no Horovod


def __getattr__(name):
    if name == "HorovodStrategy":
        from tfdist.strategies.registry import horovod_strategy_class

        globals()[name] = horovod_strategy_class()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
