"""MeshStrategy: one replica per mesh device, weights truly sharded."""

from typing import Sequence, Union

import tensorflow as tf
from absl import logging

from tfdist.comm.shape_keys import DEFAULT_MAX_SHAPES
from tfdist.comm.tf_collectives import DEFAULT_BUCKET_BYTES, TFCollectiveBackend
from tfdist.internal import hooks, install_keras_hooks, keras_loop_reads
from tfdist.internal.keras_reduce import reduce_for_keras
from tfdist.internal.shard_routing import MeshExtended
from tfdist.mesh import Mesh
from tfdist.runtime import MeshRuntime


def resolve_devices(mesh: Mesh, devices: Union[None, str, Sequence[str]] = None):
    """The devices of `mesh`, given or found, checked against its size.

    Args:
        mesh: the mesh.
        devices: device names (one per mesh device, row-major); or "gpu" /
            "cpu" for the first `mesh.size` logical devices of that kind; or
            None: GPUs when there are any, else CPUs. A machine with GPUs
            never falls back to CPUs silently: a mesh larger than its GPUs
            raises unless `devices="cpu"` asks for CPUs.
    """
    if devices is not None and not isinstance(devices, str):
        devices = [d.name if hasattr(d, "name") else str(d) for d in devices]
        dupes = sorted({d for d in devices if devices.count(d) > 1})
        if dupes:
            raise ValueError(f"Device {dupes[0]!r} appears twice in devices={devices}.")
        mesh.shape.check_devices(len(devices), "given")
        return devices
    if devices is not None and devices.lower() not in ("cpu", "gpu"):
        raise ValueError(f"devices must be a list of device names, 'cpu', 'gpu' or None; "
                         f"received devices={devices!r}.")
    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    kind = devices.lower() if devices else ("gpu" if gpus else "cpu")
    found = gpus if kind == "gpu" else cpus
    if len(found) < mesh.size:
        if kind == "gpu":
            raise ValueError(
                f"Mesh shape {mesh.shape} needs {mesh.size} devices but found "
                f"{len(gpus)} GPUs: use a mesh of at most {len(gpus)} devices, or "
                f"devices='cpu' to run the mesh on (virtual) CPU devices instead.")
        raise ValueError(
            f"Mesh shape {mesh.shape} needs {mesh.size} devices but found "
            f"{len(cpus)} CPU devices: use a smaller mesh, "
            f"or split the CPU with tfdist.split_cpu({mesh.size}) (or "
            f"tf.config.set_logical_device_configuration) before TensorFlow "
            f"initialises its devices."
        )
    return found[: mesh.size]


class MeshStrategy(MeshRuntime, tf.distribute.Strategy):
    """A `tf.distribute` strategy over a named device mesh with sharded weights.

    Every device of the mesh is one replica. Weights whose logical axes the
    layout maps to a mesh axis are stored as one shard per device (tfdist
    layers declare the axes); all other weights are replicated. The global
    batch is split over all replicas; sharded layers gather what they need with
    named-axis collectives (`tfdist.collectives`). Gradients of a sharded
    weight are summed only over the replicas that hold the same shard; those
    of replicated weights over all replicas, fused into buckets of
    `bucket_bytes` and reduced with the mesh's collectives (ring over the
    devices; NCCL on GPUs), never through one device.
    Checkpoints (`save_weights`, `model.save`, `get_weights`) hold global
    tensors, so they load onto any mesh or into a plain Keras model.

    Args:
        mesh_shape: Mesh-TF mesh shape, e.g. `"data:2;model:2"`.
        layout: Mesh-TF layout rules, e.g. `"batch:data;d_ff:model"`.
        devices: device names, one per mesh device (row-major); "gpu" or
            "cpu" for the first `size` logical devices of that kind. Default:
            GPUs when the machine has any (a mesh larger than them raises),
            else CPUs.
        collective_timeout: seconds a collective may wait for its peers before
            failing instead of hanging; 0 (default) waits forever. Each
            collective execution then holds a sleeping thread for that long,
            so keep it for debugging hangs.
        bucket_bytes: largest fused bucket of data-parallel gradients
            (default 25 MiB, PyTorch DDP's default).
        max_shapes: distinct input shapes one traced step (a Keras train,
            test or predict function) may meet. Batches may have any shape
            (length buckets, a partial last batch); TensorFlow keeps one record
            per shape for each collective whose shape varies
            (`tfdist.comm.shape_keys`), so more shapes than this fail with a
            clear error rather than grow memory without bound.
        keras_layouts: layouts of Keras weights by path (a
            `tfdist.keras_layouts.KerasLayouts`, as `tfdist.distribution.ModelParallel`
            builds it from a Keras `LayoutMap`), or None.

    Partial batches: a batch whose rows the replicas cannot share evenly (the
    last one, or a batch size the device count does not divide) is padded per
    replica and the padding counted nowhere (`tfdist.batch_rows`): `fit`,
    `evaluate` and `predict` use every row once, exactly as one device does.

    Example:

    ```python
    strategy = MeshStrategy("data:2;model:2", "batch:data;d_ff:model")
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((16,)),
            ShardedDense(64, kernel_axes=("d_model", "d_ff"), output_sharded=True),
            ShardedDense(16, kernel_axes=("d_ff", "d_model"), input_sharded=True),
        ])
        model.compile("adam", "mse")
    model.fit(x, y, batch_size=32)
    ```
    """

    # Read by MirroredExtended for the group keys of TF's own collectives
    # (unused: tfdist's backend has its own keys); distinct from MirroredStrategy's.
    _collective_key_base = 50000

    def __init__(
        self,
        mesh_shape="data:1",
        layout=None,
        devices: Union[None, str, Sequence[str]] = None,
        collective_timeout: float = 0.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        max_shapes: int = DEFAULT_MAX_SHAPES,
        *,
        keras_layouts=None,
    ):
        hooks.verify()  # the installed TF / Keras / keras-hub are the ones tfdist hooks into
        mesh = mesh_shape if isinstance(mesh_shape, Mesh) else Mesh.parse(mesh_shape, layout)
        devices = resolve_devices(mesh, devices)
        backend = TFCollectiveBackend(devices, timeout_seconds=collective_timeout,
                                      bucket_bytes=bucket_bytes, max_shapes=max_shapes)
        install_keras_hooks()
        super().__init__(MeshExtended(self, mesh, devices, backend, keras_layouts))
        self.mesh = mesh
        self._backend = backend
        logging.info("MeshStrategy: %s on %s", mesh, devices)

    def check_collective(self, what: str) -> None:  # MeshRuntime
        keras_loop_reads.check_no_loop(what)  # not inside a loop of a Keras call

    def reduce(self, reduce_op, value, axis):
        # Keras's symbolic build reduces the first batch, which replicas may hold
        # unevenly: answered locally (tfdist.internal.keras_reduce).
        return reduce_for_keras(super().reduce, self, reduce_op, value, axis)

    @property
    def backend(self) -> TFCollectiveBackend:
        return self._backend

    @property
    def is_chief(self) -> bool:
        return True  # the single controller, also of a mesh over workers

    @property
    def devices(self):
        return tuple(self.extended.worker_devices)

    def __repr__(self):
        return f"MeshStrategy({self.mesh.shape.to_string()!r}, {self.mesh.rules.to_string()!r})"
