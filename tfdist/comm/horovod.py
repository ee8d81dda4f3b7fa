"""HorovodBackend: a mesh over Horovod ranks, process sets per device group.

Rank `r` is mesh device `r` (row-major over the mesh axes). Every group of
devices a sharded layer or a shard gradient can reduce over (the devices
that differ only along some subset of the mesh axes) becomes a Horovod
process set, registered once at `hvd.init`; the whole mesh is Horovod's
global set. `HorovodBackend` implements `tfdist.comm.Backend`, so every
sharded layer runs unchanged with one shard per rank.

Horovod matches collectives across ranks by name (and orders them itself),
so each op gets the next name of a per-process counter: every rank traces
the same program, so the names agree.
"""

import contextlib
import itertools
import os
from typing import Dict

import tensorflow as tf

from tfdist.comm.base import Group, check_permutation, in_supported_dtype
from tfdist.mesh import Mesh


# Process sets tfdist registered at hvd.init, by sorted ranks: a later
# strategy on the same ranks reuses them (Horovod registers sets only at init).
_REGISTERED: Dict[Group, object] = {}


def mesh_groups(mesh: Mesh):
    """Every device group of `mesh` that needs its own process set.

    The groups along each non-empty subset of the mesh axes, except single
    devices and the whole mesh (Horovod's global set), without duplicates.
    """
    names = mesh.shape.names
    found = []
    for k in range(1, len(names) + 1):
        for axes in itertools.combinations(names, k):
            for group in mesh.shape.groups(axes):
                if 1 < len(group) < mesh.size and group not in found:
                    found.append(tuple(group))
    return found


def init_with_process_sets(hvd, mesh: Mesh) -> Dict[Group, object]:
    """Initialises Horovod with the process sets of `mesh`; returns them by group.

    Raises:
        ValueError: Horovod runs another number of ranks than the mesh has
            devices, or was initialised elsewhere without these process sets.
    """
    launched = os.environ.get("HOROVOD_SIZE")  # set by horovodrun; checked before hvd.init
    if launched is not None and not hvd.is_initialized() and int(launched) != mesh.size:
        raise ValueError(_size_error(mesh, int(launched)))
    needed = mesh_groups(mesh)
    missing = [g for g in needed if g not in _REGISTERED]
    if hvd.is_initialized():
        if missing:
            raise ValueError(
                f"Horovod was initialised before HorovodStrategy(mesh {mesh.shape}) could "
                f"register the process sets of its mesh axes {missing}: create the strategy "
                f"before anything calls hvd.init().")
    else:
        sets = {g: hvd.ProcessSet(list(g)) for g in missing}
        hvd.init(process_sets=list(sets.values()) or None)
        _REGISTERED.update(sets)
    if hvd.size() != mesh.size:
        raise ValueError(_size_error(mesh, hvd.size()))
    return {g: _REGISTERED[g] for g in needed}


def _size_error(mesh: Mesh, ranks: int) -> str:
    return (f"Mesh shape {mesh.shape} has {mesh.size} devices but Horovod runs {ranks} "
            f"ranks (one mesh device per rank): use a mesh whose sizes multiply to {ranks}, "
            f"e.g. 'data:{ranks}', or start {mesh.size} ranks (horovodrun -np {mesh.size}).")


class HorovodBackend:
    """Collectives among Horovod ranks (one mesh device per rank).

    Args:
        hvd: `horovod.tensorflow`, initialised.
        process_sets: `{group: ProcessSet}` from `init_with_process_sets`.
        compression: `hvd.Compression.none` or `.fp16`, for `batch_all_reduce`.
        adasum: `batch_all_reduce` of the whole mesh with Horovod's Adasum.
    """

    _names = itertools.count()

    def __init__(self, hvd, process_sets: Dict[Group, object], compression=None,
                 adasum: bool = False):
        self.hvd = hvd
        self.process_sets = dict(process_sets)
        self.compression = compression
        self.adasum = adasum

    def _set(self, group: Group):
        if len(group) == self.hvd.size():
            return self.hvd.global_process_set
        if group not in self.process_sets:
            raise KeyError(f"no Horovod process set for ranks {group}")
        return self.process_sets[group]

    def _name(self, kind: str) -> str:
        return f"tfdist_{kind}_{next(self._names)}"

    def all_reduce(self, x, replica: int, group: Group, merge_op: str = "Add"):
        """`merge_op` ("Add", "Max", "Min") of `x` over the ranks of `group`."""
        if len(group) == 1:
            return tf.identity(x)
        op = {"Add": self.hvd.Sum, "Max": self.hvd.Max, "Min": self.hvd.Min}[merge_op]
        return in_supported_dtype(x, lambda x: self.hvd.allreduce(
            x, op=op, process_set=self._set(group), name=self._name("allreduce")))

    def all_gather(self, x, replica: int, group: Group):
        """Concatenation along dimension 0 of `x` from each rank of `group`, in rank order."""
        if len(group) == 1:
            return tf.identity(x)
        return in_supported_dtype(x, lambda x: self.hvd.allgather(
            x, process_set=self._set(group), name=self._name("allgather")))

    def all_to_all(self, x, replica: int, group: Group, shape_varies: bool = False):
        """Splits dimension 0 into `len(group)` parts, part j to the j-th rank of `group`.

        Any shape at every execution (`shape_varies` needs nothing): Horovod
        negotiates each one by name."""
        if len(group) == 1:
            return tf.identity(x)
        return in_supported_dtype(x, lambda x: self.hvd.alltoall(
            x, process_set=self._set(group), name=self._name("alltoall")))

    def permute(self, x, replica: int, group: Group, source):
        """`x` of rank `group[source[k]]` at rank `group[k]`: one `hvd.alltoall`
        whose splits send `x` to its one receiver (nothing else moves)."""
        source = check_permutation(source, len(group))
        k = group.index(replica)
        if len(group) == 1:
            return tf.identity(x)
        target = source.index(k)
        splits = [1 if j == target else 0 for j in range(len(group))]

        def send(x):
            received, _ = self.hvd.alltoall(x[None], splits=splits, process_set=self._set(group),
                                         name=self._name("permute"))
            return tf.reshape(received, tf.shape(x))

        return in_supported_dtype(x, send)

    def batch_all_reduce(self, tensors, replica: int, group: Group):
        """Sums over `group` with one `hvd.grouped_allreduce` (Horovod fuses the tensors)."""
        tensors = [tf.convert_to_tensor(t) for t in tensors]
        if len(group) == 1 or not tensors:
            return [tf.identity(t) for t in tensors]
        op = self.hvd.Adasum if self.adasum and len(group) == self.hvd.size() else self.hvd.Sum
        compression = self.compression or self.hvd.Compression.none
        dtypes = [t.dtype for t in tensors]
        tensors = [tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t for t in tensors]
        reduced = self.hvd.grouped_allreduce(tensors, op=op, compression=compression,
                                             process_set=self._set(group),
                                             name=self._name("grads"))
        return [tf.cast(r, d) if d == tf.bfloat16 else r for r, d in zip(reduced, dtypes)]

    @contextlib.contextmanager
    def step_shapes(self, tensors):
        """Nothing to key: Horovod matches collectives by name at every execution,
        whatever their shapes."""
        del tensors
        yield
