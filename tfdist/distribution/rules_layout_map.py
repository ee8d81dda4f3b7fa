"""A Keras `LayoutMap` lowered from tfdist layout rules (keras-hub's `get_layout_map`)."""

from typing import Mapping, Optional, Sequence

import keras

from tfdist.keras_layouts import keras_mesh_shape
from tfdist.mesh import LayoutRules


class RulesLayoutMap(keras.distribution.LayoutMap):
    """A Keras `LayoutMap` whose entries are tfdist layout rules applied to logical axes.

    tfdist's models follow keras-hub's convention: `Model.get_layout_map(device_mesh,
    model_parallel_dim_name="model", data_parallel_dim_name="batch")` returns
    a `LayoutMap`. This one is made from the model's logical axes (regex over
    `variable.path` -> one logical axis per dimension) and layout rules, so it
    is an ordinary `LayoutMap` by path; it also keeps the rules.
    `tfdist.distribution.ModelParallel` gives them to tfdist's layers, which
    then run on their shards (their own tensor-parallel computation) with
    exactly the layouts the entries name. Both front ends lower to the same
    `TensorLayout`s: a weight whose rules layout and `LayoutMap` layout
    differ (say, an entry edited by hand) is an error when it is created.

    Args:
        device_mesh: the `keras.distribution.DeviceMesh`.
        layout_rules: tfdist layout rules (`"batch:batch;d_ff:model"`, pairs or
            a `LayoutRules`), naming the mesh's axes.
        logical_axes: regex key -> logical axes (one name or None per
            dimension) of the weights the key matches.

    Attributes:
        layout_rules: the parsed `LayoutRules`.
    """

    def __init__(self, device_mesh, layout_rules, logical_axes: Mapping[str, Sequence[Optional[str]]]):
        super().__init__(device_mesh)
        self.layout_rules = LayoutRules.parse(layout_rules)
        self.layout_rules.check_mesh(keras_mesh_shape(device_mesh))
        for key, axes in logical_axes.items():
            mesh_axes = tuple(self.layout_rules.mesh_axis(a) if a else None for a in axes)
            self[key] = mesh_axes if any(mesh_axes) else None


def check_dim_names(device_mesh, **names: str) -> None:
    """Raises, naming the argument, if a `*_dim_name` is not an axis of `device_mesh`."""
    for arg, name in names.items():
        if name not in device_mesh.axis_names:
            raise ValueError(f"{arg}={name!r} is not an axis of the DeviceMesh; its axes are "
                             f"{list(device_mesh.axis_names)}.")
