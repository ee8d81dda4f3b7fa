"""The mesh and layout language of tfdist, in Mesh-TensorFlow's own syntax.

Pure Python: nothing here imports TensorFlow, so every bad mesh or layout is
rejected before a graph, a device or a variable exists.

A *mesh shape* names the axes of the device mesh and their sizes:
`"data:2;model:4"` is 8 devices, device `i` at coordinates
`(data=i // 4, model=i % 4)` (row-major).

*Layout rules* map the logical axes that layers declare for their weights and
activations onto mesh axes: `"batch:data;d_ff:model;heads:model"`. A logical
axis with no rule is replicated.

As in Mesh-TensorFlow, pairs are `name:value` separated by `;`, `,`, `.` or
white space in any mix; already-parsed lists of pairs are accepted too.

Example:

```python
mesh = Mesh.parse("data:2;model:4", "batch:data;d_ff:model")
layout = mesh.tensor_layout(("d_model", "d_ff"), (512, 2048), what="ffn/kernel")
layout.mesh_axes     # (None, "model")
layout.local_shape   # (512, 512)
```
"""

import dataclasses
import math
import re
from typing import Iterable, Mapping, Optional, Sequence, Tuple, Union

LOGICAL_AXES = (
    "batch",
    "length",
    "d_model",
    "d_ff",
    "heads",
    "d_kv",
    "experts",
    "vocab",
    "classes",
    "layers",
)
"""The one vocabulary of logical axes that tfdist layers declare (`layers`: the
model's stack of layers, split over a pipeline's stage axis, `tfdist.pipeline`)."""

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SEPARATORS = re.compile(r"[,.;\s]+")

PairsLike = Union[str, Sequence[Tuple[str, object]], Mapping[str, object]]


def _split_pairs(spec: PairsLike, what: str, example: str):
    """Turns a Mesh-TF string (or pairs, or a mapping) into raw `(str, str)` pairs."""
    if isinstance(spec, str):
        pairs = []
        for token in _SEPARATORS.split(spec.strip()):
            if not token:
                continue
            parts = token.split(":")
            if len(parts) != 2 or not parts[0] or not parts[1]:
                raise ValueError(
                    f"Malformed {what} pair {token!r} in {spec!r}: expected "
                    f"'name:value' pairs separated by ';', ',', '.' or spaces, "
                    f"e.g. {example!r}."
                )
            pairs.append((parts[0], parts[1]))
        return pairs
    if isinstance(spec, Mapping):
        return [(str(k), v) for k, v in spec.items()]
    pairs = []
    for item in spec:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(
                f"Malformed {what} pair {item!r} in {spec!r}: expected "
                f"(name, value) pairs, e.g. {example!r}."
            )
        pairs.append((item[0], item[1]))
    return pairs


def _check_name(name, what: str, spec) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"Invalid {what} name {name!r} in {spec!r}: names are identifiers "
            f"such as 'data', 'model' or 'd_ff'."
        )
    return name


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """A named device mesh shape, e.g. `data:2;model:4`.

    Args:
        axes: `(name, size)` pairs in mesh order; devices are laid out
            row-major, the last axis varying fastest.

    Example:

    >>> MeshShape.parse("data:2, model:4").size
    8
    """

    axes: Tuple[Tuple[str, int], ...]

    EXAMPLE = "data:2;model:4"

    @classmethod
    def parse(cls, spec: Union["MeshShape", PairsLike]) -> "MeshShape":
        """Parses a Mesh-TF mesh shape string, a list of pairs or a mapping."""
        if isinstance(spec, MeshShape):
            return spec
        if spec is None:
            raise ValueError(
                f"A mesh shape is required, e.g. {cls.EXAMPLE!r}; received None."
            )
        pairs = _split_pairs(spec, "mesh shape", cls.EXAMPLE)
        if not pairs:
            raise ValueError(
                f"Empty mesh shape {spec!r}: a mesh needs at least one axis, "
                f"e.g. {cls.EXAMPLE!r} or 'data:1' for one device."
            )
        axes = []
        for name, size in pairs:
            _check_name(name, "mesh axis", spec)
            axes.append((name, _parse_size(name, size, spec)))
        names = [n for n, _ in axes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(
                f"Duplicate mesh axis {dupes[0]!r} in mesh shape {spec!r}: each "
                f"mesh axis may appear once, e.g. {cls.EXAMPLE!r}."
            )
        return cls(tuple(axes))

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @property
    def sizes(self) -> Tuple[int, ...]:
        return tuple(s for _, s in self.axes)

    @property
    def size(self) -> int:
        """The number of devices in the mesh."""
        return math.prod(self.sizes)

    def axis_size(self, name: Optional[str]) -> int:
        """Size of mesh axis `name`; 1 for None (a dimension no axis splits).

        Raises:
            ValueError: `name` is not an axis of this mesh.
        """
        if name is None:
            return 1
        return dict(self.axes)[self._known(name)]

    def _known(self, name: str) -> str:
        if name not in self.names:
            raise ValueError(
                f"Unknown mesh axis {name!r}: mesh {self} has axes {list(self.names)}."
            )
        return name

    def coordinates(self, device_index: int) -> Mapping[str, int]:
        """The mesh coordinates of device `device_index` (row-major)."""
        coords = {}
        rest = device_index
        for name, size in reversed(self.axes):
            coords[name] = rest % size
            rest //= size
        return {n: coords[n] for n in self.names}

    def device_index(self, coords: Mapping[str, int]) -> int:
        index = 0
        for name, size in self.axes:
            index = index * size + coords[name]
        return index

    def groups(self, axes: Iterable[str]) -> Tuple[Tuple[int, ...], ...]:
        """Partitions the devices into groups that differ only along `axes`.

        Each group lists device indices in order of their coordinates along
        `axes`, so the position within a group is the device's index along
        those axes.
        """
        axes = [self._known(a) for a in axes]
        groups = {}
        for i in range(self.size):
            coords = self.coordinates(i)
            key = tuple(coords[n] for n in self.names if n not in axes)
            groups.setdefault(key, []).append(i)
        return tuple(tuple(g) for g in groups.values())

    def check_devices(self, num_devices: int, where: str = "given") -> None:
        """Raises unless the mesh has exactly `num_devices` devices."""
        if num_devices != self.size:
            raise ValueError(
                f"Mesh shape {self} has {self.size} devices but {num_devices} "
                f"devices were {where}: use a mesh whose sizes multiply to "
                f"{num_devices}, e.g. 'data:{num_devices}', or pass "
                f"{self.size} devices."
            )

    def to_string(self) -> str:
        return ";".join(f"{n}:{s}" for n, s in self.axes)

    def __str__(self) -> str:
        return self.to_string()


def _parse_size(name: str, size, spec) -> int:
    if isinstance(size, bool):
        size = None
    elif isinstance(size, int):
        pass
    elif isinstance(size, str) and re.fullmatch(r"[+-]?\d+", size.strip()):
        size = int(size)
    else:
        size = None
    if size is None or size <= 0:
        raise ValueError(
            f"Invalid size for mesh axis {name!r} in {spec!r}: sizes are "
            f"positive integers, e.g. '{name}:2'."
        )
    return size


@dataclasses.dataclass(frozen=True)
class LayoutRules:
    """Which logical axis is split over which mesh axis, as plain data.

    Args:
        rules: `(logical_axis, mesh_axis)` pairs. Logical axes with no rule
            are replicated.

    Example:

    >>> LayoutRules.parse("batch:data;d_ff:model").mesh_axis("d_ff")
    'model'
    """

    rules: Tuple[Tuple[str, str], ...] = ()

    EXAMPLE = "batch:data;d_ff:model;heads:model;vocab:model"

    @classmethod
    def parse(cls, spec: Union["LayoutRules", PairsLike, None]) -> "LayoutRules":
        """Parses a Mesh-TF layout string, a list of pairs or a mapping.

        An empty string or None means no rules: every weight is replicated.
        """
        if isinstance(spec, LayoutRules):
            return spec
        if spec is None:
            return cls(())
        rules = []
        for logical, mesh_axis in _split_pairs(spec, "layout rule", cls.EXAMPLE):
            _check_name(logical, "logical axis", spec)
            _check_name(mesh_axis, "mesh axis", spec)
            if logical not in LOGICAL_AXES:
                raise ValueError(
                    f"Unknown logical axis {logical!r} in layout {spec!r}: "
                    f"valid logical axes are {list(LOGICAL_AXES)}."
                )
            if logical in dict(rules):
                raise ValueError(
                    f"Duplicate logical axis {logical!r} in layout {spec!r}: "
                    f"each logical axis may map to one mesh axis, e.g. "
                    f"{cls.EXAMPLE!r}."
                )
            rules.append((logical, mesh_axis))
        return cls(tuple(rules))

    def mesh_axis(self, logical_axis: str) -> Optional[str]:
        """The mesh axis `logical_axis` is split over, or None if replicated."""
        return dict(self.rules).get(logical_axis)

    def check_mesh(self, mesh_shape: MeshShape) -> None:
        """Raises if a rule points at a mesh axis the mesh does not have."""
        for logical, mesh_axis in self.rules:
            if mesh_axis not in mesh_shape.names:
                raise ValueError(
                    f"Layout rule '{logical}:{mesh_axis}' in layout {self} points "
                    f"at mesh axis {mesh_axis!r}, but mesh {mesh_shape} has axes "
                    f"{list(mesh_shape.names)}."
                )

    def to_string(self) -> str:
        return ";".join(f"{l}:{m}" for l, m in self.rules)

    def __str__(self) -> str:
        return self.to_string()


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """How one tensor of global shape `shape` lies on the mesh.

    Args:
        logical_axes: one logical axis name (or None) per dimension.
        shape: the global shape.
        mesh_axes: the mesh axis each dimension is split over, or None.
        mesh_shape: the mesh.
        padded_shape: the global shape rounded up so that every split
            dimension divides by its mesh axis (equal to `shape` unless the
            layout was made with `pad=True`); the padding lives at the end of
            the last shard.
        may_pad: the layout was made with `pad=True` (its owner masks padding),
            so the same tensor on another mesh pads rather than failing.
    """

    logical_axes: Tuple[Optional[str], ...]
    shape: Tuple[int, ...]
    mesh_axes: Tuple[Optional[str], ...]
    mesh_shape: MeshShape
    padded_shape: Optional[Tuple[int, ...]] = None
    may_pad: bool = False

    def __post_init__(self):
        if self.padded_shape is None:
            object.__setattr__(self, "padded_shape", self.shape)

    @property
    def is_sharded(self) -> bool:
        return any(
            a is not None and self.mesh_shape.axis_size(a) > 1 for a in self.mesh_axes
        )

    @property
    def sharded_mesh_axes(self) -> Tuple[str, ...]:
        """The mesh axes (of size > 1) this tensor is split over."""
        return tuple(
            a
            for a in self.mesh_axes
            if a is not None and self.mesh_shape.axis_size(a) > 1
        )

    @property
    def local_shape(self) -> Tuple[int, ...]:
        return tuple(
            n if a is None else n // self.mesh_shape.axis_size(a)
            for n, a in zip(self.padded_shape, self.mesh_axes)
        )

    @property
    def is_padded(self) -> bool:
        return self.padded_shape != self.shape

    @property
    def num_shards(self) -> int:
        return math.prod(self.mesh_shape.axis_size(a) for a in self.sharded_mesh_axes)

    def shard_slices(self, device_index: int) -> Tuple[slice, ...]:
        """The slice of the (padded) global tensor that device `device_index` holds."""
        coords = self.mesh_shape.coordinates(device_index)
        slices = []
        for local, a in zip(self.local_shape, self.mesh_axes):
            start = 0 if a is None else coords[a] * local
            slices.append(slice(start, start + local))
        return tuple(slices)

    def shard_owner_groups(self) -> Tuple[Tuple[int, ...], ...]:
        """Groups of devices that hold the same shard (their gradients add up)."""
        replicated = [n for n in self.mesh_shape.names if n not in self.sharded_mesh_axes]
        return self.mesh_shape.groups(replicated)

    def __str__(self) -> str:
        dims = ", ".join(
            f"{l or '-'}={n}" + (f"->{a}" if a else "")
            for l, n, a in zip(self.logical_axes, self.shape, self.mesh_axes)
        )
        return f"[{dims}] on mesh {self.mesh_shape}"


@dataclasses.dataclass(frozen=True)
class Mesh:
    """A mesh shape together with the layout rules that apply on it.

    Args:
        shape: the `MeshShape`.
        rules: the `LayoutRules`; each must point at an axis of `shape`.
    """

    shape: MeshShape
    rules: LayoutRules = LayoutRules(())

    def __post_init__(self):
        self.rules.check_mesh(self.shape)

    @classmethod
    def parse(cls, mesh_shape, layout=None) -> "Mesh":
        return cls(MeshShape.parse(mesh_shape), LayoutRules.parse(layout))

    @classmethod
    def single_device(cls) -> "Mesh":
        return cls(MeshShape((("data", 1),)), LayoutRules(()))

    @property
    def size(self) -> int:
        return self.shape.size

    def axis_size(self, name: Optional[str]) -> int:
        """Size of mesh axis `name`, as `MeshShape.axis_size`: 1 for None, and a
        `ValueError` for an axis this mesh lacks."""
        return self.shape.axis_size(name)

    def mesh_axis(self, logical_axis: Optional[str]) -> Optional[str]:
        return None if logical_axis is None else self.rules.mesh_axis(logical_axis)

    @property
    def splits_only_batch(self) -> bool:
        """Whether no rule but `batch`'s splits over a mesh axis of more than one device
        (pure data parallelism: replicas may hold different numbers of rows)."""
        return not any(self.axis_size(axis) > 1 and logical != "batch"
                       for logical, axis in self.rules.rules)

    def tensor_layout(
        self,
        logical_axes: Sequence[Optional[str]],
        shape: Sequence[int],
        what: str = "tensor",
        pad: bool = False,
    ) -> TensorLayout:
        """Applies the rules to a tensor, checking them as Mesh-TF does.

        Args:
            logical_axes: one logical axis (or None) per dimension.
            shape: the global shape.
            what: a name for errors, e.g. `"layer 'ffn' weight 'kernel'"`.
            pad: round split dimensions up to a multiple of their mesh axis
                instead of raising (for class and vocabulary counts; the layer
                must mask the padding).

        Raises:
            ValueError: if two dimensions map to the same mesh axis, or a
                dimension does not divide by its mesh axis size.
        """
        logical_axes = tuple(logical_axes)
        shape = tuple(int(n) for n in shape)
        if len(logical_axes) != len(shape):
            raise ValueError(
                f"{what} declares logical axes {logical_axes} for a tensor of "
                f"shape {shape}: give one logical axis (or None) per dimension."
            )
        mesh_axes = tuple(self.mesh_axis(l) for l in logical_axes)
        used = [a for a in mesh_axes if a is not None]
        dupes = sorted({a for a in used if used.count(a) > 1})
        if dupes:
            dims = [l for l, a in zip(logical_axes, mesh_axes) if a == dupes[0]]
            raise ValueError(
                f"{what} with logical axes {logical_axes} and shape {shape} maps "
                f"dimensions {dims} to the same mesh axis {dupes[0]!r} under "
                f"layout {self.rules} on mesh {self.shape}: a tensor may split "
                f"each mesh axis at most once."
            )
        padded = tuple(
            -(-n // self.shape.axis_size(a)) * self.shape.axis_size(a) if a and pad else n
            for n, a in zip(shape, mesh_axes)
        )
        for logical, n, a in zip(logical_axes, padded, mesh_axes):
            if a is not None and n % self.shape.axis_size(a):
                raise ValueError(
                    f"{what}: dimension {logical!r} of size {n} does not divide "
                    f"by mesh axis {a!r} of size {self.shape.axis_size(a)} "
                    f"(mesh {self.shape}, layout {self.rules}); use a size that "
                    f"is a multiple of {self.shape.axis_size(a)} or drop the "
                    f"rule '{logical}:{a}'."
                )
        return TensorLayout(logical_axes, shape, mesh_axes, self.shape, padded, bool(pad))

    def __str__(self) -> str:
        return f"mesh {self.shape} with layout {self.rules.to_string() or '(none)'}"
