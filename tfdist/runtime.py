"""The ambient mesh: what a tfdist strategy tells the layers and collectives.

Keras keeps one ambient distribution (`keras.distribution.distribution()`, set
by its scope); tfdist keeps one too. Every tfdist strategy that runs a mesh
(`MeshStrategy`, `HorovodStrategy`) is a `MeshRuntime`, and everything that
needs the mesh reads it through one function:

    runtime = current_runtime()      # the MeshRuntime in scope, or None
    mesh = current_mesh()            # its Mesh, or the one-device mesh

Outside such a strategy (no strategy, `MirroredStrategy`, ...) there is no
runtime: tfdist layers see a one-device mesh and every named-axis collective
is the identity.
"""

import abc
import contextlib
import threading
from typing import Optional

from tfdist.mesh import Mesh


class MeshRuntime(abc.ABC):
    """What every tfdist mesh strategy provides.

    Attributes:
        mesh: the `tfdist.mesh.Mesh` (shape and layout rules).
        backend: the `tfdist.comm.Backend` its collectives run on.
    """

    mesh: Mesh

    @property
    @abc.abstractmethod
    def backend(self):
        """The `tfdist.comm.Backend` of this mesh."""

    def mesh_device_index(self, local_replica: int) -> int:
        """The mesh device index of this process's replica `local_replica`."""
        return self.extended.mesh_device_index(local_replica)

    @property
    @abc.abstractmethod
    def is_chief(self) -> bool:
        """Whether this process writes checkpoints and logs."""

    @property
    def collective_weight_reads(self) -> bool:
        """Whether reading a sharded weight globally is a collective of all processes.

        False where one process holds every shard (a single controller).
        """
        return False

    @property
    def process_index(self) -> int:
        """This process's index among those that run Python (a single controller: 0)."""
        return 0

    @property
    def process_count(self) -> int:
        """How many processes run Python for this mesh (a single controller: 1)."""
        return 1

    def barrier(self, name: str) -> None:
        """Waits for every process that runs Python (a single controller: returns)."""

    def check_collective(self, what: str) -> None:
        """Called by `tfdist.collectives` before a replica traces collective `what`;
        raises where it cannot run. tfdist's strategies refuse one inside a loop of a
        Keras call (`tfdist.internal.keras_loop_reads`)."""


def current_runtime(strategy=None) -> Optional[MeshRuntime]:
    """The `MeshRuntime` of `strategy` (default: the strategy in scope), or None."""
    if strategy is None:
        import tensorflow as tf

        strategy = tf.distribute.get_strategy()
    return strategy if isinstance(strategy, MeshRuntime) else None


def current_mesh() -> Mesh:
    """The mesh of the strategy in scope, else the one `weights_on` names, else a one-device mesh."""
    runtime = current_runtime()
    if runtime is not None:
        return runtime.mesh
    planned = getattr(_local, "meshes", None)
    return planned[-1] if planned else Mesh.single_device()


_local = threading.local()  # `weights_on`'s meshes, per thread


@contextlib.contextmanager
def weights_on(mesh: Mesh):
    """Layers built inside lay their weights out for `mesh`, with no strategy.

    For listing the weights a model would make on a mesh (`tfdist.planner`):
    build inside `tfdist.planner.unallocated()` too, so that nothing is
    allocated; no collective runs (there is no runtime).
    """
    stack = getattr(_local, "meshes", None)
    if stack is None:
        stack = _local.meshes = []
    stack.append(mesh)
    try:
        yield mesh
    finally:
        stack.pop()


def is_chief(strategy=None) -> bool:
    """Whether this process writes checkpoints and logs.

    A tfdist mesh strategy answers for itself (`MeshRuntime.is_chief`: the
    single controller, or Horovod rank 0). Under another strategy with a
    cluster (`MultiWorkerMirroredStrategy`) only the `chief` task, or worker 0
    when the cluster has no chief; a single process always.
    """
    if strategy is None:
        import tensorflow as tf

        strategy = tf.distribute.get_strategy()
    mesh_runtime = current_runtime(strategy)
    if mesh_runtime is not None:
        return mesh_runtime.is_chief
    resolver = getattr(strategy, "cluster_resolver", None)  # tf.distribute's public attribute
    if resolver is None or not resolver.cluster_spec().as_dict():
        return True
    jobs = resolver.cluster_spec().as_dict()
    if "chief" in jobs:
        return resolver.task_type == "chief"
    return resolver.task_type == "worker" and resolver.task_id == 0


def process_index(strategy=None) -> int:
    """This process's index among the processes that run Python for the job (0 if one)."""
    mesh_runtime = current_runtime(strategy)
    return 0 if mesh_runtime is None else mesh_runtime.process_index


def process_count(strategy=None) -> int:
    """How many processes run Python for the job (1 for a single controller)."""
    mesh_runtime = current_runtime(strategy)
    return 1 if mesh_runtime is None else mesh_runtime.process_count


def barrier(strategy=None, name: str = "tfdist_barrier") -> None:
    """Returns when every process of the job has called it (nothing to wait for with one)."""
    mesh_runtime = current_runtime(strategy)
    if mesh_runtime is not None:
        mesh_runtime.barrier(name)
