"""Bytes per device of a model under a candidate layout.

Weights and optimizer variables are exact: each variable is stored as its
`Mesh.tensor_layout` lays it out (`local_shape`, padded where its layer pads),
which is what `tfdist.testing.memory.device_bytes` counts on a real
`MeshStrategy`. Gradients hold one local copy of every trainable weight at the
end of the backward pass. Activations are the workload's estimate
(`tfdist.planner.workload`).
"""

import dataclasses
import math

from tfdist.mesh import Mesh
from tfdist.planner.inventory import Entry, Inventory


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes one device holds during a training step."""

    weights: int
    optimizer: int
    gradients: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.gradients + self.activations

    @property
    def state(self) -> int:
        """Weights and optimizer variables: what lives between steps."""
        return self.weights + self.optimizer


def local_bytes(entry: Entry, mesh: Mesh) -> int:
    """Bytes of `entry`'s shard on one device of `mesh` (all shards are equal).

    Raises:
        ValueError: a split dimension does not divide (and may not pad), or
            two dimensions map to one mesh axis.
    """
    layout = mesh.tensor_layout(entry.axes, entry.shape, what=f"weight {entry.path!r}",
                                pad=entry.may_pad)
    return math.prod(layout.local_shape) * entry.itemsize


def state_bytes(inventory: Inventory, mesh: Mesh):
    """`(weights, optimizer, gradients)` bytes on one device of `mesh`."""
    weights = sum(local_bytes(e, mesh) for e in inventory.weights)
    optimizer = sum(local_bytes(e, mesh) for e in inventory.optimizer)
    gradients = sum(local_bytes(e, mesh) for e in inventory.weights if e.trainable)
    return weights, optimizer, gradients
