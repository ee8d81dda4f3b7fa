"""The routing plan: over which replicas each gradient of a step is summed.

`ShardRouting.reduce_gradients` (`tfdist.internal.shard_routing`) receives one
optimizer step's `(gradient, variable)` pairs in cross-replica context. This
module decides what happens to each pair, from the variables' layouts alone;
the strategy then runs the plan on its backend.

- A replicated weight's gradient is summed over every replica. Dense ones
  travel in fused buckets, one collective per bucket.
- A sharded weight's gradient is summed over the replicas that hold the same
  shard (`TensorLayout.shard_owner_groups`). A ZeRO-1 weight's is summed over
  its `LayoutMap` layout's owners, then cut (`tfdist.core.zero`).
- A sparse gradient (`IndexedSlices`, a Keras `Embedding`) is gathered over
  the same group and stays sparse.
- A tensor that is the same in every replica (made outside `strategy.run`)
  is already the global gradient, as MirroredStrategy takes it.

Dense positions are listed last layer first, so the first fused bucket is
ready first in the backward pass.
"""

import dataclasses
from typing import Dict, List, Sequence, Tuple

from tfdist.core.zero import reduction_groups
from tfdist.mesh import TensorLayout

DENSE, SPARSE, AS_IS = "dense", "sparse", "as_is"
KINDS = (DENSE, SPARSE, AS_IS)

Group = Tuple[int, ...]


def is_sharded(variable) -> bool:
    """Whether `variable` is stored split by a `TensorLayout` (a tfdist sharded variable)."""
    return isinstance(getattr(variable, "layout", None), TensorLayout)


@dataclasses.dataclass(frozen=True)
class ReductionPlan:
    """What one step does with each gradient, for the replicas of this process.

    Attributes:
        dense: per local replica, `{group: positions}`, where `group` holds the
            mesh device indices the gradients at `positions` are summed over
            (fused, in that order: last layer first).
        sparse: per local replica, `{position: group}` for sparse gradients,
            gathered over `group`.
        as_is: positions whose gradient is already global.
    """

    dense: Tuple[Dict[Group, List[int]], ...]
    sparse: Tuple[Dict[int, Group], ...]
    as_is: Tuple[int, ...]


def plan_reduction(variables: Sequence, kinds: Sequence[str],
                   device_indices: Sequence[int], mesh_size: int) -> ReductionPlan:
    """The plan for gradients of `variables`, each of kind `kinds[k]` (`KINDS`).

    `device_indices[i]` is the mesh device index of this process's replica
    `i`; `mesh_size` is the number of devices of the mesh.
    """
    if len(kinds) != len(variables):
        raise ValueError(f"one kind per variable: {len(kinds)} kinds for "
                         f"{len(variables)} variables.")
    everyone = tuple(range(mesh_size))
    dense = [dict() for _ in device_indices]
    sparse = [dict() for _ in device_indices]
    as_is = []
    for k, (variable, kind) in enumerate(zip(variables, kinds)):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}; received {kind!r}.")
        if kind == AS_IS:
            as_is.append(k)
            continue
        groups = reduction_groups(variable, everyone) if is_sharded(variable) else [everyone]
        for i, index in enumerate(device_indices):
            group = tuple(next(g for g in groups if index in g))
            if kind == SPARSE:
                sparse[i][k] = group
            else:
                dense[i].setdefault(group, []).append(k)
    dense = tuple({group: positions[::-1] for group, positions in d.items()} for d in dense)
    return ReductionPlan(dense, tuple(sparse), tuple(as_is))
