"""The mesh and layout language: parsing, round trips, and every bad input."""

import pytest

from tfdist.mesh import LOGICAL_AXES, LayoutRules, Mesh, MeshShape


@pytest.mark.parametrize(
    "spec",
    ["data:2;model:4", "data:2,model:4", "data:2.model:4", "data:2 model:4",
     " data:2 ;, model:4 ", "data:2;\tmodel:4;", [("data", 2), ("model", 4)],
     [("data", "2"), ("model", "4")], {"data": 2, "model": 4}],
)
def test_mesh_shape_accepts_every_separator_and_pairs(spec):
    shape = MeshShape.parse(spec)
    assert shape.axes == (("data", 2), ("model", 4))
    assert shape.size == 8
    assert MeshShape.parse(shape.to_string()) == shape
    assert str(shape) == "data:2;model:4"


def test_layout_rules_parse_and_round_trip():
    rules = LayoutRules.parse("batch:data, d_ff:model.heads:model vocab:model")
    assert rules.rules == (("batch", "data"), ("d_ff", "model"), ("heads", "model"),
                           ("vocab", "model"))
    assert rules.mesh_axis("d_ff") == "model"
    assert rules.mesh_axis("d_model") is None
    assert LayoutRules.parse(rules.to_string()) == rules
    assert LayoutRules.parse([("experts", "model")]).mesh_axis("experts") == "model"
    assert LayoutRules.parse("").rules == ()
    assert LayoutRules.parse(None).rules == ()


def test_coordinates_are_row_major_and_groups_follow_axes():
    shape = MeshShape.parse("data:2;model:4")
    assert shape.coordinates(6) == {"data": 1, "model": 2}
    assert shape.device_index({"data": 1, "model": 2}) == 6
    assert shape.groups(["model"]) == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert shape.groups(["data"]) == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert shape.groups([]) == tuple((i,) for i in range(8))


def test_tensor_layout_shards():
    mesh = Mesh.parse("data:2;model:4", "batch:data;d_ff:model")
    layout = mesh.tensor_layout(("d_model", "d_ff"), (6, 8), what="w")
    assert layout.mesh_axes == (None, "model")
    assert layout.local_shape == (6, 2)
    assert layout.is_sharded and layout.num_shards == 4
    assert layout.shard_slices(6) == (slice(0, 6), slice(4, 6))
    assert layout.shard_owner_groups() == ((0, 4), (1, 5), (2, 6), (3, 7))
    replicated = mesh.tensor_layout(("d_model", "heads"), (6, 3))
    assert not replicated.is_sharded and replicated.local_shape == (6, 3)
    trivial = Mesh.parse("data:2;model:1", "d_ff:model").tensor_layout(("d_ff",), (3,))
    assert not trivial.is_sharded


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("data:2;model", "Malformed mesh shape pair 'model'"),
        ("data:2;:4", "Malformed mesh shape pair ':4'"),
        ("data:", "Malformed mesh shape pair 'data:'"),
        ("data:2:3", "Malformed mesh shape pair 'data:2:3'"),
        ("", "Empty mesh shape"),
        ("data:0", "Invalid size for mesh axis 'data'"),
        ("data:-2", "Invalid size for mesh axis 'data'"),
        ("data:2x", "Invalid size for mesh axis 'data'"),
        ([("data", 2.5)], "Invalid size for mesh axis 'data'"),
        ([("data", True)], "Invalid size for mesh axis 'data'"),
        ("data:2;data:4", "Duplicate mesh axis 'data'"),
        ("2data:2", "Invalid mesh axis name '2data'"),
        ([("data",)], "Malformed mesh shape pair"),
    ],
)
def test_bad_mesh_shapes_name_the_bad_value(spec, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")) as e:
        MeshShape.parse(spec)
    assert "e.g." in str(e.value) or "names are identifiers" in str(e.value)


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("batch:data;d_ff", "Malformed layout rule pair 'd_ff'"),
        ("batch:data;d_ff:model;d_ff:data", "Duplicate logical axis 'd_ff'"),
        ("dff:model", "Unknown logical axis 'dff'"),
        ("d_ff:1model", "Invalid mesh axis name '1model'"),
    ],
)
def test_bad_layouts_name_the_bad_value(spec, fragment):
    with pytest.raises(ValueError, match=fragment) as e:
        LayoutRules.parse(spec)
    assert spec in str(e.value)


def test_unknown_logical_axis_lists_the_vocabulary():
    with pytest.raises(ValueError) as e:
        LayoutRules.parse("dff:model")
    for axis in LOGICAL_AXES:
        assert axis in str(e.value)


def test_rule_pointing_at_a_missing_mesh_axis():
    with pytest.raises(ValueError, match=r"'d_ff:model'.*mesh axis 'model'.*\['data'\]"):
        Mesh.parse("data:4", "d_ff:model")


def test_tensor_mapping_two_dims_to_one_mesh_axis():
    mesh = Mesh.parse("data:2;model:2", "d_model:model;d_ff:model")
    with pytest.raises(ValueError, match=r"kernel.*\('d_model', 'd_ff'\).*\(4, 8\).*same mesh axis 'model'.*data:2;model:2"):
        mesh.tensor_layout(("d_model", "d_ff"), (4, 8), what="kernel")


def test_dimension_not_divisible_names_everything():
    mesh = Mesh.parse("data:1;model:4", "d_ff:model")
    with pytest.raises(ValueError) as e:
        mesh.tensor_layout(("d_model", "d_ff"), (4, 6), what="Layer 'ffn' weight 'kernel'")
    message = str(e.value)
    for part in ("Layer 'ffn' weight 'kernel'", "'d_ff'", "size 6", "'model'", "size 4"):
        assert part in message


def test_device_count_mismatch():
    with pytest.raises(ValueError, match=r"data:2;model:4 has 8 devices but 6 devices were given"):
        MeshShape.parse("data:2;model:4").check_devices(6)


def test_mesh_module_does_not_import_tensorflow():
    import subprocess
    import sys

    code = "import sys, tfdist.mesh; assert 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_padded_layout_rounds_up_split_dimensions():
    mesh = Mesh.parse("data:1;model:4", "classes:model")
    layout = mesh.tensor_layout(("d_model", "classes"), (3, 1001), pad=True)
    assert layout.is_padded and layout.padded_shape == (3, 1004)
    assert layout.local_shape == (3, 251)
    assert layout.shard_slices(3) == (slice(0, 3), slice(753, 1004))
    assert not mesh.tensor_layout(("d_model", "classes"), (3, 1000), pad=True).is_padded
    with pytest.raises(ValueError, match="size 1001 does not divide"):
        mesh.tensor_layout(("d_model", "classes"), (3, 1001))


def test_mesh_and_mesh_shape_agree_on_axis_sizes():
    mesh = Mesh.parse("data:2;model:4", "batch:data;d_ff:model")
    for sizes in (mesh, mesh.shape):
        assert sizes.axis_size("model") == 4 and sizes.axis_size(None) == 1
        with pytest.raises(ValueError, match=r"Unknown mesh axis 'stage': mesh .* has axes "
                                             r"\['data', 'model'\]"):
            sizes.axis_size("stage")
