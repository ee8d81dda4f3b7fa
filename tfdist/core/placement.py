"""Placement: the layout a new variable gets under a tfdist strategy, from what creates it.

The strategy's variable creator (`ShardRouting._create_variable` in
`tfdist.internal.shard_routing`) sees four kinds of variables:

1. **A tfdist layer's weight** (`tfdist.layers.weights.add_sharded_weight`)
   carries its layout. Under a Keras `LayoutMap` too, the map must agree with
   it (`KerasLayouts.check_agrees`).
2. **An optimizer slot** is created colocated with its weight and takes the
   weight's layout when it has the weight's shape (Keras's
   `add_variable_from_reference`). A slot of another shape (factored second
   moments) cannot be split like its weight: one clear error.
3. **A Keras weight under a `LayoutMap`** takes the map's layout by its path.
   Any layer reads it whole (gathered, FSDP) unless its call runs on shards.
   With `zero_stage`, a weight the map leaves whole on the batch axis is split
   over it too, and stages 1 and 2 keep a whole copy that replicas read
   (`tfdist.core.zero`).
4. **Anything else** (Keras's own weights without a map, metrics, counters) is
   replicated.

`place` decides; the creator makes the variable and its kept copy.
"""

import dataclasses
from typing import Optional, Sequence

from tfdist.mesh import TensorLayout

SLOT_FROM_REFERENCE = None
"""`slot_shape` of a slot made from its weight (Keras's `add_variable_from_reference`):
the weight's shape, whatever it is."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a new variable lives.

    Attributes:
        layout: its layout; None or unsharded: replicated on every device.
        kept_base: ZeRO-1/2, a weight split over the batch axis: the `LayoutMap`'s
            own layout of it, which the kept whole copy has.
        keeps_whole: whether replicas read a kept whole copy (ZeRO-1/2).
        gather_on_read: a `LayoutMap` weight: read whole (gathered) in a replica
            unless its layer's call runs on shards.
    """

    layout: Optional[TensorLayout] = None
    kept_base: Optional[TensorLayout] = None
    keeps_whole: bool = False
    gather_on_read: bool = False

    @property
    def sharded(self) -> bool:
        return self.layout is not None and self.layout.is_sharded


REPLICATED = Placement()


def place(layout: Optional[TensorLayout] = None, *, slot_of=None, slot_shape=SLOT_FROM_REFERENCE,
          keras_path: Optional[str] = None, keras_shape: Optional[Sequence[int]] = None,
          trainable: bool = True, keras_layouts=None) -> Placement:
    """The placement of a new variable.

    Args:
        layout: the layout a tfdist layer's weight carries, or None.
        slot_of: the sharded variable a slot is colocated with (it has a
            `layout`), or None.
        slot_shape: the slot's shape; `SLOT_FROM_REFERENCE` for Keras's slots.
        keras_path, keras_shape: the Keras variable being created (its path
            and global shape), when Keras creates it from an initializer.
        trainable: whether the variable is trainable (ZeRO splits only those).
        keras_layouts: the strategy's `tfdist.keras_layouts.KerasLayouts`, or None.
    """
    if layout is not None:  # 1. a tfdist layer's weight
        if slot_of is None and keras_layouts is not None and keras_path is not None:
            keras_layouts.check_agrees(keras_path, layout)
        return Placement(layout)
    if slot_of is not None:  # 2. an optimizer slot
        return Placement(slot_layout(slot_of, slot_shape))
    if keras_layouts is not None and keras_path is not None:  # 3. a LayoutMap weight
        layout = keras_layouts.layout(keras_path, keras_shape)
        zero = keras_layouts.zero_layout(layout, keras_shape, trainable)
        if zero is None:
            return Placement(layout, gather_on_read=True)
        return Placement(zero, kept_base=layout, keeps_whole=keras_layouts.keeps_whole,
                         gather_on_read=True)
    return REPLICATED  # 4.


def slot_layout(primary, shape) -> TensorLayout:
    """The layout of a slot of sharded variable `primary`: its own, if shapes agree."""
    if shape is SLOT_FROM_REFERENCE:
        return primary.layout
    if tuple(shape) != primary.layout.shape:
        raise ValueError(
            f"A variable of shape {tuple(shape)} colocated with sharded variable "
            f"{primary.name!r} (global shape {primary.layout.shape}, layout "
            f"{primary.layout}) cannot be sharded like it; optimizers whose slots have "
            f"another shape (e.g. factored second moments) are not supported for sharded "
            f"weights.")
    return primary.layout
