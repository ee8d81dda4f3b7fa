"""tf.distribute strategies, chosen by name with `get_strategy`."""

from tfdist.strategies.averaging import CommunicationBytes, ModelAveragingStrategy
from tfdist.strategies.mesh_strategy import MeshStrategy
from tfdist.strategies.multi_worker import MultiWorkerStrategy
from tfdist.strategies.registry import STRATEGY_NAMES, get_strategy

__all__ = ["CommunicationBytes", "MeshStrategy", "ModelAveragingStrategy", "MultiWorkerStrategy",
           "STRATEGY_NAMES",
           "get_strategy"]
