"""tf.distribute strategies, chosen by name with `get_strategy`."""

from tfdist.strategies.mesh_strategy import MeshStrategy
from tfdist.strategies.registry import STRATEGY_NAMES, get_strategy

__all__ = ["MeshStrategy", "STRATEGY_NAMES", "get_strategy"]
