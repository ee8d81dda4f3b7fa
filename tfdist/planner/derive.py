"""Logical axes for any Keras model's weights, and the `LayoutMap` a layout gives them.

keras-hub writes a `get_layout_map` by hand for five backbones, and a renamed
weight silently falls back to replicated (keras-hub#2806). Here the axes come
from the weights themselves, in tfdist's vocabulary, so any layout rules
(`heads:model;d_ff:model;vocab:model;d_model:data`) lower to a `LayoutMap`:

    d_model   the model's hidden size: the dimension an embedding table rows
              out to, else the most common dimension among the kernels
    vocab     an `Embedding` / `ReversibleEmbedding` table's other dimension
    d_ff      a 2-D kernel's (`Dense`, `EinsumDense`) dimension that is not
              d_model: split over a model axis the layer is column-parallel
              (d_model contracted) or row-parallel (d_model produced), Megatron's
              pairs (gate / up then down) falling out of the shapes
    heads     a 3-D kernel's first dimension that is not d_model (attention's
              query / key / value `[d, n, h]` or `[n, d, h]`, its output
              `[n, h, d]`); `d_kv` the other
    None      everything else (norm scales, biases, scalars): replicated

A `d_model` rule onto the batch axis is FSDP (as keras-hub's maps put
`data_dim` on the hidden dimension). Rules that split a dimension that does not
divide are caught by the planner, which drops the layout.
"""

import collections
import re
from typing import Dict, Optional, Tuple

from tfdist.mesh import Mesh

Axes = Tuple[Optional[str], ...]


def _is_embedding(layer) -> bool:
    return type(layer).__name__ in ("Embedding", "ReversibleEmbedding")


def _is_kernel_layer(layer) -> bool:
    return type(layer).__name__ in ("Dense", "EinsumDense")


def _leaf_variables(model):
    """`(layer, variable)` for every weight, with the innermost layer that owns it."""
    from tfdist.internal.keras_layers import all_layers

    seen = set()
    layers = sorted(all_layers(model, include_self=False),
                    key=lambda l: -len(getattr(l, "path", "") or ""))
    for layer in layers:  # innermost (longest path) first
        for v in layer.weights:
            if id(v) not in seen:
                seen.add(id(v))
                yield layer, v
    for v in model.weights:
        if id(v) not in seen:
            yield model, v


def hidden_size(model) -> int:
    """d_model: an embedding table's row width, else the most common kernel dimension."""
    sizes = collections.Counter()
    for layer, v in _leaf_variables(model):
        shape = tuple(int(n) for n in v.shape)
        if _is_embedding(layer) and len(shape) == 2 and v.path.endswith("/embeddings"):
            return shape[1]
        if _is_kernel_layer(layer) and len(shape) >= 2:
            sizes.update(shape)
    if not sizes:
        raise ValueError("the model has no Dense, EinsumDense or Embedding weight to lay out.")
    return sizes.most_common(1)[0][0]


def logical_axes(model) -> Dict[str, Axes]:
    """`{variable path: logical axes}` for every weight of a built Keras `model`."""
    d_model = hidden_size(model)
    out = {}
    for layer, v in _leaf_variables(model):
        shape = tuple(int(n) for n in v.shape)
        axes: list = [None] * len(shape)
        if _is_embedding(layer) and len(shape) == 2:
            if shape[1] == d_model:
                axes = ["vocab", "d_model"]
            elif shape[0] == d_model:  # reverse (untied output) embeddings
                axes = ["d_model", "vocab"]
        elif _is_kernel_layer(layer) and len(shape) in (2, 3) and d_model in shape:
            model_dim = shape.index(d_model) if len(shape) == 2 or shape[-1] != d_model \
                else len(shape) - 1
            axes[model_dim] = "d_model"
            others = [i for i in range(len(shape)) if i != model_dim]
            if len(shape) == 2:
                axes[others[0]] = "d_ff"
            else:
                axes[others[0]], axes[others[1]] = "heads", "d_kv"
        out[v.path] = tuple(axes)
    return out


def layout_map(model, device_mesh, rules, axes: Optional[Dict[str, Axes]] = None):
    """A `keras.distribution.LayoutMap` laying `model`'s weights out by `rules`.

    Args:
        model: a built Keras model.
        device_mesh: the `keras.distribution.DeviceMesh` (its axis names are the
            mesh axes the rules name).
        rules: tfdist `LayoutRules` (or their string), e.g.
            `"heads:model;d_ff:model;vocab:model;d_model:batch"`.
        axes: `logical_axes(model)` if already computed.

    Returns:
        A `LayoutMap` with one key per weight that the rules split. A key is
        the weight's path as a regex with its layer numbers generalized
        (`decoder_block_\\d+/...`) when every weight it then matches has the
        same layout, else the exact path.
    """
    import keras

    axes = axes if axes is not None else logical_axes(model)
    mesh = Mesh.parse(";".join(f"{n}:{s}" for n, s in zip(device_mesh.axis_names,
                                                           device_mesh.shape)), rules)
    wanted = {}
    for path, logical in axes.items():
        mesh_axes = tuple(mesh.mesh_axis(a) for a in logical)
        if any(a is not None for a in mesh_axes):
            wanted[path] = mesh_axes
    general = collections.defaultdict(set)
    for path, mesh_axes in wanted.items():
        general[_general_key(path)].add(mesh_axes)
    out = keras.distribution.LayoutMap(device_mesh)
    keys = set()  # (`key in out` asks the map's regex lookup, which never raises)
    for path, mesh_axes in wanted.items():
        key = _general_key(path)
        if len(general[key]) != 1 or any(_matches(key, p) and p not in wanted
                                         for p in axes):
            key = f"^{re.escape(path)}$"
        if key not in keys:
            keys.add(key)
            out[key] = mesh_axes
    return out


def _general_key(path: str) -> str:
    return "^" + re.sub(r"_\d+", r"_\\d+", re.escape(path)) + "$"


def _matches(key: str, path: str) -> bool:
    return re.search(key, path) is not None
