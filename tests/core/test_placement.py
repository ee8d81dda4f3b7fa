"""tfdist.core.placement: the four kinds of new variables, placed from their layouts alone.

The expected layouts are written out from the mesh by hand; a `KerasLayouts` is
Keras's own `LayoutMap` as `tfdist.distribution` reads it.
"""

import dataclasses

import keras
import pytest

from tfdist.core import placement
from tfdist.keras_layouts import KerasLayouts
from tfdist.mesh import Mesh

MESH = Mesh.parse("data:2;model:2", "batch:data;d_ff:model")


@dataclasses.dataclass
class _Sharded:
    layout: object
    name: str = "kernel"


def _keras_layouts(zero_stage=0):
    mesh = keras.distribution.DeviceMesh((2, 2), ("batch", "model"),
                                         [f"cpu:{i}" for i in range(4)])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense/kernel"] = (None, "model")
    return KerasLayouts.for_mesh(mesh, layout_map, "batch", zero_stage=zero_stage)


def test_a_tfdist_layers_weight_keeps_its_layout():
    layout = MESH.tensor_layout(("d_model", "d_ff"), (4, 8))
    assert placement.place(layout) == placement.Placement(layout)


def test_a_slot_takes_its_weights_layout_or_refuses_another_shape():
    weight = _Sharded(MESH.tensor_layout(("d_model", "d_ff"), (4, 8)))
    assert placement.place(slot_of=weight).layout is weight.layout  # Keras's slots
    assert placement.place(slot_of=weight, slot_shape=(4, 8)).layout is weight.layout
    with pytest.raises(ValueError, match=r"shape \(4,\) colocated with sharded variable "
                                         r"'kernel'.*factored second moments"):
        placement.place(slot_of=weight, slot_shape=(4,))


def test_a_layout_map_weight_is_laid_out_by_path_and_gathered_on_read():
    layouts = _keras_layouts()
    split = placement.place(keras_path="dense/kernel", keras_shape=(4, 8), keras_layouts=layouts)
    assert split.sharded and split.gather_on_read and not split.keeps_whole
    assert split.layout.mesh_axes == (None, "model")
    other = placement.place(keras_path="dense/bias", keras_shape=(8,), keras_layouts=layouts)
    assert not other.sharded and other.gather_on_read


@pytest.mark.parametrize("stage, keeps_whole", [(1, True), (2, True), (3, False)])
def test_zero_splits_trainable_weights_over_the_batch_axis(stage, keeps_whole):
    layouts = _keras_layouts(zero_stage=stage)
    bias = placement.place(keras_path="dense/bias", keras_shape=(8,), keras_layouts=layouts)
    assert bias.layout.mesh_axes == ("batch",) and bias.keeps_whole is keeps_whole
    assert bias.kept_base is None  # not in the map: its kept copy is whole
    kernel = placement.place(keras_path="dense/kernel", keras_shape=(4, 8),
                             keras_layouts=layouts)
    assert kernel.layout.mesh_axes == ("batch", "model")
    assert kernel.kept_base.mesh_axes == (None, "model")  # the map's own layout
    frozen = placement.place(keras_path="dense/bias", keras_shape=(8,), trainable=False,
                             keras_layouts=layouts)
    assert not frozen.sharded


def test_everything_else_is_replicated():
    assert placement.place() is placement.REPLICATED
    assert placement.place(keras_path="dense/kernel", keras_shape=(4, 8)) is placement.REPLICATED
