"""What a model stores: every weight and optimizer variable, with its logical axes.

The planner reads a model once, built on one device, and from then on works
on this plain-data inventory: a candidate layout's bytes per device follow
from each entry's global shape, its logical axes and the candidate's rules
(`Mesh.tensor_layout`), as tfdist's layers and MeshStrategy lay them out.

    weights:   one `Entry` per `model.weights` variable; logical axes from the
               layer's `weight_layouts` (tfdist layers), else all None.
    optimizer: one `Entry` per optimizer variable; a slot made from a weight
               (Adam's momentum, velocity) takes that weight's axes, the rest
               (iteration, learning rate) are replicated.
"""

import dataclasses
import math

import numpy as np
from typing import Optional, Sequence, Tuple


@dataclasses.dataclass(frozen=True)
class Entry:
    """One variable: `path`, global `shape`, `itemsize` bytes per element,
    logical `axes` (one per dimension, None = never split), whether it is
    `trainable`, whether a split may pad it (`may_pad`), and for an optimizer
    slot the path of the `weight` it mirrors (None for weights and counters)."""

    path: str
    shape: Tuple[int, ...]
    itemsize: int
    axes: Tuple[Optional[str], ...]
    trainable: bool = True
    may_pad: bool = False
    weight: Optional[str] = None

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclasses.dataclass(frozen=True)
class Inventory:
    """A model's weights and its optimizer's variables (see the module docstring)."""

    weights: Tuple[Entry, ...]
    optimizer: Tuple[Entry, ...] = ()

    @property
    def logical_axes(self) -> Tuple[str, ...]:
        """The logical axes some weight declares, in first-seen order."""
        seen = []
        for entry in self.weights:
            for axis in entry.axes:
                if axis is not None and axis not in seen:
                    seen.append(axis)
        return tuple(seen)

    @property
    def num_parameters(self) -> int:
        return sum(math.prod(e.shape) for e in self.weights)

    @classmethod
    def of(cls, model, optimizer=None, axes=None) -> "Inventory":
        """The inventory of a built Keras `model` and (optionally) `optimizer`.

        Args:
            model: a built Keras model, made outside any tfdist strategy.
            optimizer: a fresh Keras optimizer (or its name, e.g. `"adam"`),
                built here on stand-ins of `model`'s trainable weights to list
                the variables it makes for them.
            axes: `{variable path: logical axes}` for weights no tfdist layer
                declares (`tfdist.planner.derive.logical_axes` for any Keras model).

        Returns:
            An `Inventory`.
        """
        import keras

        from tfdist.internal.keras_layers import all_layers

        layouts = {}
        for layer in all_layers(model):
            for name, layout in getattr(layer, "weight_layouts", {}).items():
                layouts[f"{layer.path}/{name}"] = layout
        weights = []
        for v in model.weights:
            layout = layouts.get(v.path)
            shape = tuple(int(n) for n in v.shape)
            if layout is not None:
                logical = tuple(layout.logical_axes)
            else:
                logical = tuple((axes or {}).get(v.path, (None,) * len(shape)))
            weights.append(Entry(v.path, shape, _itemsize(v.dtype), logical, bool(v.trainable),
                                 bool(layout is not None and layout.may_pad)))
        slots = ()
        if optimizer is not None:
            slots = _optimizer_entries(keras.optimizers.get(optimizer), weights)
        return cls(tuple(weights), slots)


def _itemsize(dtype) -> int:
    return np.dtype(str(dtype).replace("bfloat16", "float16")).itemsize


def _optimizer_entries(optimizer, weights: Sequence[Entry]) -> Tuple[Entry, ...]:
    """The variables `optimizer` makes for `weights`, each slot with its weight's axes.

    The optimizer is built on one-element stand-ins of the trainable weights
    (nothing of their size is allocated), named after them: Keras names a slot
    `{weight path with '/' -> '_'}_{slot name}` (`add_variable_from_reference`)
    with its weight's shape. Optimizers with slots of another shape (Adafactor's
    factored moments) are refused.
    """
    import keras

    trainable = [w for w in weights if w.trainable]
    stand_ins = [keras.Variable(np.zeros((1,) * len(w.shape), "float32"), name=_flat(w.path),
                                dtype=_dtype(w.itemsize)) for w in trainable]
    by_prefix = sorted(((_flat(w.path) + "_", w, s) for w, s in zip(trainable, stand_ins)),
                       key=lambda entry: -len(entry[0]))
    optimizer.build(stand_ins)
    out = []
    for v in optimizer.variables:
        name = v.path.split("/", 1)[-1]
        match = next(((w, s) for prefix, w, s in by_prefix if name.startswith(prefix)), None)
        if match is None:  # the optimizer's own counters (iteration, learning rate)
            shape = tuple(int(n) for n in v.shape)
            out.append(Entry(v.path, shape, v.dtype and _itemsize(v.dtype), (None,) * len(shape),
                             False))
            continue
        weight, stand_in = match
        if tuple(v.shape) != tuple(stand_in.shape):
            raise ValueError(
                f"optimizer {type(optimizer).__name__} makes variable {v.path!r} of another "
                f"shape than its weight {weight.path!r}; the planner counts optimizers whose "
                f"slots mirror their weights (Adam, AdamW, SGD, RMSprop, Adagrad, Lion, ...).")
        out.append(Entry(f"{optimizer.name}/{_flat(weight.path)}{name[len(_flat(weight.path)):]}",
                         weight.shape, _itemsize(v.dtype), weight.axes, False, weight.may_pad,
                         weight.path))
    return tuple(out)


def _flat(path: str) -> str:
    return path.replace("/", "_")


def _dtype(itemsize: int) -> str:
    return {2: "float16", 4: "float32", 8: "float64"}[itemsize]
