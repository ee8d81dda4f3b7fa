"""TPU launches: `TPUClusterResolver` -> `TPUStrategy`, the mesh mapped onto the cores.

    strategy = tpu_strategy("my-tpu", zone="us-central2-b", project="my-project",
                            mesh_shape="data:4;model:2")

The mesh's last axis (`model`) becomes the cores of one replica (the
computation shape); the other axes multiply into the number of replicas. The
mesh size must equal the number of TPU cores, checked before the strategy is
built. `python -m tfdist.launch --tpu NAME -- script.py` runs the script once
(a TPU program has a single controller) with `TFDIST_TPU*` set, and
`get_strategy("tpu")` reads them.
"""

import os
from typing import Optional

from tfdist.mesh import MeshShape

TPU_ENV = ("TFDIST_TPU", "TFDIST_TPU_ZONE", "TFDIST_GCP_PROJECT")


def tpu_env(tpu: str, zone: str = "", project: str = "") -> dict:
    """The environment `get_strategy("tpu")` reads in a launched script."""
    return dict(zip(TPU_ENV, (tpu, zone, project)))


def tpu_strategy(tpu: Optional[str] = None, zone: Optional[str] = None,
                 project: Optional[str] = None, mesh_shape="data:1", tf=None):
    """Connects to a TPU and returns a `TPUStrategy` laid out like `mesh_shape`.

    Args:
        tpu: the TPU name or `grpc://` address (default: `TFDIST_TPU`; "" or
            "local" for a TPU VM).
        zone, project: GCP zone and project (default: from the environment).
        mesh_shape: Mesh-TF mesh shape; its size must equal the core count.
        tf: the TensorFlow module (tests pass a mock).

    Raises:
        ValueError: no TPU name, or a mesh that does not fit the cores.
    """
    if tf is None:
        import tensorflow as tf
    tpu = tpu if tpu is not None else os.environ.get("TFDIST_TPU")
    if tpu is None:
        raise ValueError("No TPU given: pass tpu='NAME' (or set TFDIST_TPU, or use "
                         "python -m tfdist.launch --tpu NAME).")
    zone = zone or os.environ.get("TFDIST_TPU_ZONE") or None
    project = project or os.environ.get("TFDIST_GCP_PROJECT") or None
    shape = MeshShape.parse(mesh_shape)
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
        tpu=tpu, zone=zone, project=project)
    tf.config.experimental_connect_to_cluster(resolver)
    topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    cores = topology.num_tasks * topology.num_tpus_per_task
    shape.check_devices(cores, f"found on TPU {tpu!r}")
    per_replica = shape.sizes[-1] if len(shape.sizes) > 1 else 1
    assignment = tf.tpu.experimental.DeviceAssignment.build(
        topology, computation_shape=_computation_shape(per_replica),
        num_replicas=shape.size // per_replica)
    return tf.distribute.TPUStrategy(resolver, experimental_device_assignment=assignment)


def _computation_shape(cores: int):
    """Cores of one replica as a [x, y, z, core] block (1, 2, 4 or 8 cores)."""
    shapes = {1: [1, 1, 1, 1], 2: [1, 1, 1, 2], 4: [2, 1, 1, 2], 8: [2, 2, 1, 2]}
    if cores not in shapes:
        raise ValueError(f"The last mesh axis maps to the cores of one TPU replica and "
                         f"must be 1, 2, 4 or 8; received {cores}.")
    return shapes[cores]
