"""Keras `LayoutMap` layouts lowered onto a tfdist mesh, checked by variable path (pure Python)."""

from typing import Optional, Sequence, Tuple

from tfdist.mesh import MeshShape, TensorLayout


def keras_mesh_shape(device_mesh) -> MeshShape:
    """The tfdist `MeshShape` of a `keras.distribution.DeviceMesh` (its names and sizes)."""
    names = tuple(device_mesh.axis_names)
    sizes = tuple(int(n) for n in device_mesh.shape)
    if len(names) != len(sizes):
        raise ValueError(f"DeviceMesh axis_names={names} and shape={sizes} differ in length.")
    return MeshShape.parse(";".join(f"{a}:{n}" for a, n in zip(names, sizes)))


class KerasLayouts:
    """The layouts a Keras `LayoutMap` gives variables, as tfdist `TensorLayout`s.

    Keras's semantics: keys are regexes that match the whole `variable.path`
    (`re.fullmatch`, after an exact key); a path matching two keys is an error; a path matching none is replicated. A
    layout may be shorter than the variable's rank (the trailing dimensions
    are replicated, as a JAX `PartitionSpec`), never longer.

    Args:
        layout_map: a `keras.distribution.LayoutMap` (or None: all replicated).
        mesh_shape: the tfdist `MeshShape` of the strategy's mesh.
        batch_axis: the mesh axis the batch is named after (`batch_dim_name`);
            weights split over it are always gathered when read (FSDP).
        reshard_after_forward: FSDP weights of the layers tfdist knows are
            gathered again for the backward pass (see `ModelParallel`).
        prefetch: those gathers run one layer ahead (see `ModelParallel`).
        zero_stage: 0, or ZeRO's stage for trainable weights the map does not
            split over the batch axis (see `ModelParallel`): 1 and 2 store them
            split over the batch axis too, with a kept whole copy
            (`keeps_whole`), stage 1 all-reducing their gradients whole, stage 2
            reduce-scattering them; 3 stores them split, gathered when read (FSDP).
    """

    def __init__(self, layout_map, mesh_shape: MeshShape, batch_axis: str,
                 reshard_after_forward: bool = True, zero_stage: int = 0,
                 prefetch: bool = False):
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0 (off), 1 (optimizer states split over "
                             f"the batch axis, weights kept whole), 2 (gradients split too) "
                             f"or 3 (weights split too); received zero_stage={zero_stage!r}.")
        self.zero_stage = int(zero_stage)
        self.reshard_after_forward = bool(reshard_after_forward)
        self.prefetch = bool(prefetch)
        self.layout_map = layout_map
        self.mesh_shape = mesh_shape
        if batch_axis not in mesh_shape.names:
            raise ValueError(f"batch_dim_name={batch_axis!r} is not an axis of the mesh "
                             f"{mesh_shape}; its axes are {list(mesh_shape.names)}.")
        self.batch_axis = batch_axis
        for key, spec in ([] if layout_map is None else layout_map.items()):
            self._check_spec(spec, f"LayoutMap key {key!r}")

    @classmethod
    def for_mesh(cls, device_mesh, layout_map, batch_dim_name: Optional[str] = None,
                 reshard_after_forward: bool = True, zero_stage: int = 0,
                 prefetch: bool = False) -> "KerasLayouts":
        """The layouts of `layout_map` (or None) on a Keras `DeviceMesh`; the batch
        axis defaults to the mesh's first."""
        mesh_shape = keras_mesh_shape(device_mesh)
        return cls(layout_map, mesh_shape, batch_dim_name or mesh_shape.names[0],
                   reshard_after_forward=reshard_after_forward, zero_stage=zero_stage,
                   prefetch=prefetch)

    def _check_spec(self, spec, what):
        mesh = getattr(spec, "device_mesh", None)
        if mesh is not None and (tuple(mesh.axis_names) != self.mesh_shape.names or
                                 tuple(int(n) for n in mesh.shape) != self.mesh_shape.sizes):
            raise ValueError(
                f"{what} is laid out on a DeviceMesh of shape {tuple(mesh.shape)} with axes "
                f"{tuple(mesh.axis_names)}, but the strategy's mesh is {self.mesh_shape}: "
                f"build the LayoutMap from the same DeviceMesh.")
        axes = tuple(getattr(spec, "axes", spec))
        for axis in axes:
            if axis is not None and axis not in self.mesh_shape.names:
                raise ValueError(
                    f"{what}: layout {axes} names mesh axis {axis!r}, which the mesh "
                    f"{self.mesh_shape} does not have; valid axes are "
                    f"{list(self.mesh_shape.names)} (or None).")
        used = [a for a in axes if a is not None]
        dupes = sorted({a for a in used if used.count(a) > 1})
        if dupes:
            raise ValueError(f"{what}: layout {axes} splits two dimensions over mesh axis "
                             f"{dupes[0]!r}; a tensor may split each mesh axis at most once.")
        return axes

    def mesh_axes(self, path: str, shape: Sequence[int]) -> Optional[Tuple[Optional[str], ...]]:
        """The mesh axis (or None) of each dimension of the variable at `path`, or None.

        Raises:
            ValueError: naming `path`, if two keys match it or its layout is
                longer than the variable's rank.
        """
        if self.layout_map is None:
            return None
        spec = self.layout_map[path]  # Keras raises if two keys match
        if spec is None:
            return None
        shape = tuple(int(n) for n in shape)
        what = f"Variable {path!r} of shape {shape}"
        axes = self._check_spec(spec, what)
        if len(axes) > len(shape):
            raise ValueError(
                f"{what}: its layout {axes} has {len(axes)} dimensions, more than the "
                f"variable's rank {len(shape)}; give at most one mesh axis (or None) per "
                f"dimension.")
        return axes + (None,) * (len(shape) - len(axes))

    def check_agrees(self, path: str, layout: TensorLayout) -> None:
        """Raises if the `LayoutMap` splits the variable at `path` other than `layout` does.

        For tfdist's own layers, whose layouts come from layout rules: both
        front ends must lower to the same layout (`RulesLayoutMap`).
        """
        axes = self.mesh_axes(path, layout.shape)
        if axes is None:
            axes = (None,) * len(layout.shape)

        def split(mesh_axes):
            return tuple(a if a is not None and self.mesh_shape.axis_size(a) > 1 else None
                         for a in mesh_axes)

        if split(axes) != split(layout.mesh_axes):
            raise ValueError(
                f"Variable {path!r} of shape {layout.shape}: the LayoutMap lays it out "
                f"{axes}, but the layout rules give {layout.mesh_axes} (logical axes "
                f"{layout.logical_axes}); make the LayoutMap entry match the rules, or "
                f"build the map with the model's get_layout_map.")

    def layout(self, path: str, shape: Sequence[int]) -> Optional[TensorLayout]:
        """The layout of the variable at `path` of global `shape`, or None (replicated).

        Raises:
            ValueError: naming `path`, if two keys match it, the layout is longer
                than the variable's rank, or a dimension does not divide.
        """
        shape = tuple(int(n) for n in shape)
        axes = self.mesh_axes(path, shape)
        if axes is None:
            return None
        what = f"Variable {path!r} of shape {shape}"
        for n, axis in zip(shape, axes):
            if axis is not None and n % self.mesh_shape.axis_size(axis):
                raise ValueError(
                    f"{what}: dimension of size {n} does not divide by mesh axis {axis!r} "
                    f"of size {self.mesh_shape.axis_size(axis)} (layout {axes}); use a size "
                    f"that is a multiple of {self.mesh_shape.axis_size(axis)} or lay that "
                    f"dimension out on another axis (or None).")
        return TensorLayout((None,) * len(shape), shape, axes, self.mesh_shape)

    def zero_layout(self, layout: Optional[TensorLayout], shape: Sequence[int],
                    trainable: bool) -> Optional[TensorLayout]:
        """The storage layout ZeRO gives a weight the map lays out `layout`, or None.

        None (the map's layout stands) with `zero_stage` 0, for a non-trainable
        variable (it has no optimizer state), when the batch axis has one device
        or the layout already splits a dimension over it, and when no unsplit
        dimension divides by the batch axis's size (small odd weights stay
        whole: a scalar, a bias of odd width). Otherwise the first such
        dimension is split over the batch axis as well.
        """
        size = self.mesh_shape.axis_size(self.batch_axis)
        shape = tuple(int(n) for n in shape)
        axes = (None,) * len(shape) if layout is None else layout.mesh_axes
        if not self.zero_stage or not trainable or size == 1 or self.batch_axis in axes:
            return None
        for dim, (n, axis) in enumerate(zip(shape, axes)):
            if axis is None and n % size == 0:
                zero_axes = axes[:dim] + (self.batch_axis,) + axes[dim + 1:]
                return TensorLayout((None,) * len(shape), shape, zero_axes, self.mesh_shape)
        return None

    @property
    def keeps_whole(self) -> bool:
        """Whether weights ZeRO splits keep a whole copy for reading (stages 1 and 2)."""
        return self.zero_stage in (1, 2)
