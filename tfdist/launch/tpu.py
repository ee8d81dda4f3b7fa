"""TPU launches: `TPUClusterResolver` -> `TPUStrategy`, pure data parallelism.

    strategy = tpu_strategy("my-tpu", zone="us-central2-b", project="my-project",
                            mesh_shape="data:8")

Only pure data parallelism is supported on TPU today: one replica per TPU
core, each computing on its slice of every global batch, gradients all-reduced
by `TPUStrategy`. tfdist's sharded layers do not shard under `TPUStrategy`
(they see a one-device mesh), so a mesh with any other axis of size > 1
(`"data:4;model:2"`) is rejected with a `ValueError` before any TPU is
contacted, rather than silently replicating what it was meant to split. The
mesh size must equal the number of TPU cores, checked once the TPU system is
initialised. `python -m tfdist.launch --tpu NAME -- script.py` runs the script
once (a TPU program has a single controller) with `TFDIST_TPU*` set, and
`get_strategy("tpu")` reads them.
"""

import os
from typing import Optional

from tfdist.mesh import MeshShape

TPU_ENV = ("TFDIST_TPU", "TFDIST_TPU_ZONE", "TFDIST_GCP_PROJECT")
DATA_AXIS = "data"


def tpu_env(tpu: str, zone: str = "", project: str = "") -> dict:
    """The environment `get_strategy("tpu")` reads in a launched script."""
    return dict(zip(TPU_ENV, (tpu, zone, project)))


def _check_data_parallel(mesh_shape) -> MeshShape:
    """Parses `mesh_shape` and checks that it asks for pure data parallelism.

    Args:
        mesh_shape: a Mesh-TF mesh shape, e.g. `"data:8"`; every axis but
            `data` must have size 1.

    Returns:
        The parsed `MeshShape`.

    Raises:
        ValueError: a malformed mesh shape, or an axis other than `data` of
            size > 1 (model parallelism, not supported on TPU yet).
    """
    shape = MeshShape.parse(mesh_shape)
    other = [f"{name}:{size}" for name, size in shape.axes if name != DATA_AXIS and size > 1]
    if other:
        raise ValueError(
            f"Only pure data parallelism is supported on TPU today (mesh_shape='data:N', one "
            f"replica per TPU core); received mesh_shape={shape.to_string()!r}, whose axes "
            f"{other} are not '{DATA_AXIS}'. Model parallelism on TPU does not exist yet: "
            f"under TPUStrategy tfdist's sharded layers see a one-device mesh and shard "
            f"nothing. Use mesh_shape='data:{shape.size}'.")
    return shape


def tpu_strategy(tpu: Optional[str] = None, zone: Optional[str] = None,
                 project: Optional[str] = None, mesh_shape="data:1", tf=None):
    """Connects to a TPU and returns a `TPUStrategy` with one replica per core.

    Args:
        tpu: the TPU name or `grpc://` address (default: `TFDIST_TPU`; "" or
            "local" for a TPU VM).
        zone, project: GCP zone and project (default: from the environment).
        mesh_shape: `"data:N"` with N the number of TPU cores (axes other
            than `data` must have size 1).
        tf: the TensorFlow module (tests pass a mock).

    Returns:
        A `tf.distribute.TPUStrategy` over all the cores.

    Raises:
        ValueError: no TPU name, a mesh with a model axis (checked before
            connecting), or a mesh whose size is not the core count.
    """
    shape = _check_data_parallel(mesh_shape)
    tpu = tpu if tpu is not None else os.environ.get("TFDIST_TPU")
    if tpu is None:
        raise ValueError("No TPU given: pass tpu='NAME' (or set TFDIST_TPU, or use "
                         "python -m tfdist.launch --tpu NAME).")
    if tf is None:
        import tensorflow as tf
    zone = zone or os.environ.get("TFDIST_TPU_ZONE") or None
    project = project or os.environ.get("TFDIST_GCP_PROJECT") or None
    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(
        tpu=tpu, zone=zone, project=project)
    tf.config.experimental_connect_to_cluster(resolver)
    topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    cores = topology.num_tasks * topology.num_tpus_per_task
    shape.check_devices(cores, f"found on TPU {tpu!r}")
    return tf.distribute.TPUStrategy(resolver)
