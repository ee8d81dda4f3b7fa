"""Sharded weights as global tensors: one layout's shards assembled and split.

A weight tfdist stores split is one component per mesh device, component `i`
holding `TensorLayout.shard_slices(i)` of the global tensor (zero-padded where
the layout pads). This module has the two directions and the variable-creator
keyword that hands a weight's layout to the strategy. Pure TF ops.
"""

import tensorflow as tf

from tfdist.mesh import TensorLayout

LAYOUT_KWARG = "tfdist_layout"
"""Variable-creator keyword that carries a weight's `TensorLayout` to the strategy."""


def assemble_global(layout: TensorLayout, shards):
    """Concatenates per-device shards (indexed by device) into the global tensor.

    Padding (see `TensorLayout.padded_shape`) is cut off.
    """
    mesh = layout.mesh_shape
    split = [(dim, axis) for dim, axis in enumerate(layout.mesh_axes) if axis in layout.sharded_mesh_axes]

    def build(level, coords):
        if level == len(split):
            full = {n: coords.get(n, 0) for n in mesh.names}
            return shards[mesh.device_index(full)]
        dim, axis = split[level]
        return tf.concat(
            [build(level + 1, {**coords, axis: k}) for k in range(mesh.axis_size(axis))],
            axis=dim,
        )

    full = build(0, {})
    if layout.is_padded:
        full = full[tuple(slice(0, n) for n in layout.shape)]
    return full


def split_global(layout: TensorLayout, value):
    """Splits a global value into per-device shards (zero-padded where the layout pads)."""
    if layout.is_padded:
        value = tf.pad(value, [[0, p - n] for n, p in zip(layout.shape, layout.padded_shape)])
    return [value[layout.shard_slices(i)] for i in range(layout.mesh_shape.size)]
