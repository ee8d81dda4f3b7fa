"""One function turns a strategy name into a strategy."""

import tensorflow as tf

from tfdist.mesh import Mesh
from tfdist.strategies.averaging import ModelAveragingStrategy
from tfdist.strategies.mesh_strategy import MeshStrategy
from tfdist.strategies.multi_worker import MultiWorkerStrategy


def _default(**options):
    _no_options("default", options)
    return tf.distribute.get_strategy()


def _one_device(device="/cpu:0", **options):
    _no_options("one_device", options)
    return tf.distribute.OneDeviceStrategy(device)


def _mirrored(devices=None, **options):
    _no_options("mirrored", options)
    return tf.distribute.MirroredStrategy(devices)


def _mesh_of(name, mesh_shape, layout) -> Mesh:
    """`mesh_shape` as a `Mesh`: a `Mesh` as is, else parsed with `layout`."""
    if isinstance(mesh_shape, Mesh):
        if layout is not None:
            raise ValueError(
                f"Strategy {name!r} takes a Mesh (which has its layout) or a mesh shape and a "
                f"layout, not both; received mesh_shape={mesh_shape} and layout={layout!r}.")
        return mesh_shape
    return Mesh.parse(mesh_shape, layout)


def _mesh(mesh_shape="data:1", layout=None, devices=None, **options):
    """A mesh over this process's devices (`devices`, or all of one kind)."""
    return MeshStrategy(_mesh_of("mesh", mesh_shape, layout), devices=devices, **options)


def _mesh_cluster(mesh_shape="data:1", layout=None, devices_per_worker=None, cluster=None,
                  **options):
    """A mesh over the tasks of `cluster` or TF_CONFIG (single controller; serves and exits
    elsewhere)."""
    if cluster is None:
        from tfdist.cluster import ClusterConfig

        cluster = ClusterConfig.from_env()
    if cluster is None:
        raise ValueError("Strategy 'mesh_cluster' needs TF_CONFIG (python -m tfdist.launch sets "
                         "it) or cluster=ClusterConfig.from_hosts([...], task_index).")
    mesh = _mesh_of("mesh_cluster", mesh_shape, layout)
    return MeshStrategy(mesh, devices=cluster.mesh_devices(mesh.size, devices_per_worker),
                        **options)


def _multi_worker(communication="ring", **options):
    """Data parallelism between the tasks of TF_CONFIG."""
    return MultiWorkerStrategy(communication=communication, **options)


def horovod_strategy_class():
    """Imports and returns `HorovodStrategy`, or says how to build Horovod.

    Imports `horovod.tensorflow` first, so a missing (or broken) Horovod build
    fails here with one message, not deep inside the strategy.

    Raises:
        ImportError: `import horovod.tensorflow` fails; the message says to run
            `make horovod` (or `scripts/install_horovod.sh`).
    """
    try:
        import horovod.tensorflow  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"HorovodStrategy needs Horovod built against this TensorFlow, but "
            f"`import horovod.tensorflow` failed ({e}). Build it with `make horovod` "
            f"(or `scripts/install_horovod.sh [PYTHON]`).") from e
    from tfdist.strategies.horovod import HorovodStrategy

    return HorovodStrategy


def _horovod(mesh_shape=None, layout=None, **options):
    """Horovod ranks; with `mesh_shape`, rank r is device r of that mesh."""
    if isinstance(mesh_shape, Mesh):
        mesh = _mesh_of("horovod", mesh_shape, layout)
        mesh_shape, layout = mesh.shape, mesh.rules
    return horovod_strategy_class()(mesh_shape=mesh_shape, layout=layout, **options)


def _tpu(mesh_shape="data:1", **options):
    """A TPUStrategy over the cores of a TPU (pure data parallelism)."""
    from tfdist.launch.tpu import tpu_strategy

    if isinstance(mesh_shape, Mesh):
        mesh_shape = mesh_shape.shape
    return tpu_strategy(mesh_shape=mesh_shape, **options)


def _averaging(**options):
    return ModelAveragingStrategy(**options)


def _no_options(name, options):
    if options:
        raise ValueError(f"Strategy {name!r} takes no options {sorted(options)}.")


_FACTORIES = {
    "default": _default,
    "one_device": _one_device,
    "mirrored": _mirrored,
    "mesh": _mesh,
    "mesh_cluster": _mesh_cluster,
    "multi_worker": _multi_worker,
    "averaging": _averaging,
    "horovod": _horovod,
    "tpu": _tpu,
}

STRATEGY_NAMES = tuple(_FACTORIES)


def get_strategy(name: str, **options):
    """Returns the strategy called `name`, built with `options`.

    Args:
        name: one of `STRATEGY_NAMES` (`default`, `one_device`, `mirrored`,
            `mesh`, `mesh_cluster`, `multi_worker`, `averaging`, `horovod`, `tpu`).
        **options: keyword arguments of that strategy. Wherever a mesh is
            taken, `mesh_shape` is a Mesh-TF shape string (with `layout`, the
            layout rules) or a `tfdist.mesh.Mesh`:

            - `one_device`: `device` (default `"/cpu:0"`).
            - `mirrored`: `devices`.
            - `mesh`: `mesh_shape`, `layout`, `devices` (default: all GPUs,
              else all CPUs), `collective_timeout`, and the rest of
              `MeshStrategy`'s arguments.
            - `mesh_cluster`: `mesh_shape`, `layout`, `devices_per_worker`
              (default: `TFDIST_DEVICES_PER_WORKER`, else 1), `cluster` (a
              `tfdist.cluster.ClusterConfig`; default: TF_CONFIG), and
              `MeshStrategy`'s arguments but `devices`. Off the controller the
              process serves the mesh and exits instead of returning.
            - `multi_worker`: `communication` (`"ring"`, `"nccl"` or
              `"auto"`), `timeout_seconds`, `cluster_resolver`.
            - `averaging`: `ModelAveragingStrategy`'s arguments.
            - `horovod`: `mesh_shape`, `layout`, `compression`, `reduction`,
              `device`.
            - `tpu`: `tpu`, `zone`, `project`, `mesh_shape` (`"data:N"`, one
              replica per core).

    Returns:
        A `tf.distribute.Strategy`.

    Raises:
        ValueError: an unknown name (listing the valid ones), or an option the
            strategy rejects (a malformed mesh, a mesh that does not fit the
            devices, a missing TF_CONFIG, ...).
        ImportError: `horovod` without a Horovod build (says to run
            `make horovod`).

    Example:

    ```python
    strategy = get_strategy("mesh", mesh_shape="data:2;model:2",
                            layout="batch:data;d_ff:model")
    strategy = get_strategy("mesh_cluster", mesh_shape=Mesh.parse("data:2;model:2"),
                            devices_per_worker=2)  # under python -m tfdist.launch
    ```
    """
    if name not in _FACTORIES:
        raise ValueError(
            f"Unknown strategy {name!r}: valid strategies are {list(STRATEGY_NAMES)}."
        )
    return _FACTORIES[name](**options)
